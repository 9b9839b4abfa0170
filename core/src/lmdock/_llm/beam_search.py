"""vLLM's ``LLM.beam_search`` on lmdock's beam search: its parameters and its output shapes.

vLLM runs beam search as a loop of one-token requests outside its engine; lmdock's beam search is a
``SamplingParams(beam_width=...)`` request (transformers' semantics, every backend that declares
``beam_search``), so this module only translates the parameters in and the outputs back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmdock._config.sampling import SamplingParams, StructuredOutput
from lmdock._llm.outputs import PositionLogprobs


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``.  ``temperature`` must stay 0: lmdock's beams are ranked by the
    model's log-probabilities, as vLLM's are in its default ``raw_logprobs`` mode."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutput | None = None
    skip_special_tokens: bool = True

    def sampling_params(self) -> SamplingParams:
        """The lmdock request that runs this search: every beam returned (``n = beam_width``)."""
        if self.temperature != 0.0:
            raise ValueError(f"BeamSearchParams: temperature={self.temperature}: lmdock's beam search ranks beams by the "
                             "model's log-probabilities, which temperature does not change; leave it at 0")
        return SamplingParams(beam_width=self.beam_width, n=self.beam_width, max_new_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos, temperature=0.0, length_penalty=self.length_penalty,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              structured_output=self.structured_outputs, skip_special_tokens=self.skip_special_tokens)


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM returns it: ``tokens`` and ``text`` cover the prompt and the beam's tokens."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search(llm: Any, prompts: Any, params: BeamSearchParams, use_tqdm: bool | None) -> list[BeamSearchOutput]:
    """Run ``params`` over ``prompts`` (one prompt or a list: text, token ids, vLLM's prompt dicts)."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"beam_search takes BeamSearchParams(beam_width, max_tokens, ...), not {type(params).__name__}; "
                        "for lmdock's own spelling pass SamplingParams(beam_width=...) to generate()")
    sp = params.sampling_params()
    tok = llm.get_tokenizer()
    results = []
    for out in llm.generate(prompts, sp, use_tqdm=use_tqdm):
        sequences = []
        for c in out.outputs:
            tokens = list(out.prompt_token_ids) + list(c.token_ids)
            text = tok.decode(tokens, skip_special_tokens=params.skip_special_tokens) if tok is not None else None
            sequences.append(BeamSearchSequence(tokens, list(c.logprobs or []), c.cumulative_logprob or 0.0, text,
                                                c.finish_reason, c.stop_reason))
        results.append(BeamSearchOutput(sequences))
    return results
