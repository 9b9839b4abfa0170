"""lmdock._engine.output: one sampled token at a time, the stop conditions (EOS after min_new_tokens, stop
token ids, stop strings, the length limit) and the snapshot a sink receives.  Sequences are built as the
loop builds them, over the FAKE step engine's tokenizer (core plumbing only: ``fakes.py``)."""

from __future__ import annotations

from fakes import FakeStepEngine
from lmdock import SamplingParams
from lmdock._engine.output import OutputProcessor
from lmdock._engine.sampler import Sample
from lmdock._engine.sequence import Req, Seq
from lmdock._plugin.contract import EngineRequest

ENGINE = FakeStepEngine()
TOK = ENGINE.tokenizer
EOS = 2


def completion(params: SamplingParams, prompt: str = "ab") -> tuple[OutputProcessor, Seq]:
    ids = TOK.encode(prompt, add_special_tokens=False)
    req = Req(EngineRequest("r", prompt, ids, params), sink=None, processors=())  # type: ignore[arg-type]
    seq = Seq(0, req, 0, ENGINE)  # type: ignore[arg-type]
    req.seqs.append(seq)
    return OutputProcessor(TOK, ENGINE.eos_token_ids, max_seq_len=64), seq


def feed(out: OutputProcessor, seq: Seq, text: str) -> None:
    for tok in TOK.encode(text, add_special_tokens=False):
        assert seq.finish_reason is None, "fed past the end"
        out.append(seq, Sample(tok))


def test_tokens_become_text_and_the_length_limit_ends_the_completion() -> None:
    out, seq = completion(SamplingParams(max_new_tokens=3))
    feed(out, seq, "cat")
    assert (seq.text, seq.finish_reason, seq.num_output) == ("cat", "length", 3)


def test_eos_ends_it_only_after_min_new_tokens_and_never_with_ignore_eos() -> None:
    out, seq = completion(SamplingParams(min_new_tokens=2, max_new_tokens=8))
    out.append(seq, Sample(EOS))
    assert seq.finish_reason is None  # 1 < min_new_tokens
    out.append(seq, Sample(EOS))
    assert seq.finish_reason == "stop" and seq.stop_reason is None
    out, seq = completion(SamplingParams(ignore_eos=True, max_new_tokens=2))
    out.append(seq, Sample(EOS))
    assert seq.finish_reason is None


def test_a_stop_token_id_is_the_stop_reason() -> None:
    stop = TOK.encode("z", add_special_tokens=False)[0]
    out, seq = completion(SamplingParams(stop_token_ids=[stop], max_new_tokens=8))
    feed(out, seq, "az")
    assert (seq.finish_reason, seq.stop_reason, seq.text) == ("stop", stop, "a")


def test_a_stop_string_cuts_the_text_and_is_held_back_until_it_is_decided() -> None:
    out, seq = completion(SamplingParams(stop=["c."], max_new_tokens=16))
    feed(out, seq, "abc")
    assert seq.finish_reason is None and seq.visible_text() == "ab"  # "c" may start the stop string
    feed(out, seq, ".")
    assert (seq.finish_reason, seq.stop_reason, seq.text) == ("stop", "c.", "ab")


def test_the_snapshot_is_what_the_sink_receives() -> None:
    out, seq = completion(SamplingParams(max_new_tokens=2, logprobs=0))
    out.append(seq, Sample(TOK.encode("x", add_special_tokens=False)[0], logprob=-0.5))
    snap = out.snapshot(seq.req)  # type: ignore[arg-type]
    assert not snap.finished and snap.prompt == "ab" and snap.outputs[0].text == "x"
    out.append(seq, Sample(TOK.encode("y", add_special_tokens=False)[0], logprob=-0.25))
    snap = out.snapshot(seq.req)  # type: ignore[arg-type]
    first = snap.outputs[0]
    assert snap.finished and (first.text, first.finish_reason, first.cumulative_logprob) == ("xy", "length", -0.75)
    assert first.token_ids == TOK.encode("xy", add_special_tokens=False) and len(first.logprobs) == 2
