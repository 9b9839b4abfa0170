"""One conversation through the chat pipeline: plan -> render -> constrain -> request -> read.

``LLM.chat`` and ``lmdock serve``'s chat, Responses and Messages routes all run a :class:`ChatCall`:
the plan (how tools and thinking are treated, with the model's parsers), the prompt the chat template
renders, the sampling parameters with the grammar that keeps forced calls valid (and a thinking
budget), the engine request, and the reading of each finished completion into content, reasoning and
tool calls.  It uses only the ``LLM``'s public calls.
"""

from __future__ import annotations

from typing import Any

from lmdock._config.sampling import SamplingParams
from lmdock._llm.lora import LoRARequest
from lmdock._llm.multimodal import chat_images, processor_adds_special_tokens
from lmdock._llm.outputs import RequestOutput
from lmdock._plugin.contract import EngineRequest
from lmdock._plugin.errors import RequestError


class ChatCall:
    """A conversation on ``llm``: :attr:`plan` at once (a RequestError naming a tool field that cannot
    be honoured), then :meth:`render`, :meth:`constrain`, :meth:`request` (or the server's
    ``LLM.open_stream`` of it), and :meth:`read` of the output."""

    def __init__(self, llm: Any, messages: list[dict[str, Any]], *, chat_template: str | None = None,
                 add_generation_prompt: bool = True, continue_final_message: bool = False,
                 chat_template_kwargs: dict[str, Any] | None = None, tools: Any = None, tool_choice: Any = None,
                 parallel_tool_calls: bool | None = None, lora_request: LoRARequest | str | None = None) -> None:
        #: the messages with each image part as ``{"type": "image"}`` (the template's own placeholder),
        #: and their images in order, undecoded (decoded with the request, under ``llm.image_limits``)
        self.messages, self.images = chat_images(messages)
        self.llm, self.chat_template = llm, chat_template
        self.add_generation_prompt, self.continue_final_message = add_generation_prompt, continue_final_message
        self.chat_template_kwargs, self.lora_request = chat_template_kwargs, lora_request
        self.plan = llm.chat_plan(tools, tool_choice, parallel_tool_calls, chat_template, chat_template_kwargs)
        self.prompt: str | None = None  # once rendered
        self.budget_held = False  # a thinking budget asked for is held (see constrain)

    def render(self) -> str:
        """The prompt the template renders (the tools as its ``tools`` variable); the plan learns what
        the prompt opened (a thinking block...).  Safe to call on a worker thread."""
        prompt = self.llm.render_chat(self.messages, self.chat_template, self.add_generation_prompt,
                                      self.continue_final_message, self.chat_template_kwargs, tools=self.plan.template_tools)
        self.plan.after_render(prompt)
        self.prompt = prompt
        return prompt

    def constrain(self, params: SamplingParams, thinking_budget: int | None = None) -> SamplingParams:
        """``params`` with the structured output that keeps the plan's calls valid, where it needs one;
        ``thinking_budget``: the thinking held to that many tokens where the engine samples in lmdock's
        step loop and the prompt opens the thinking (:attr:`budget_held` says whether it is)."""
        params = self.llm.constrained(params, self.plan)
        if thinking_budget is not None and self.llm.backend.kind == "step":
            budget = self.plan.thinking_budget(thinking_budget, self.llm.tokenizer, self._rendered())
            if budget is not None:
                params = params.replace(logits_processors=(*params.logits_processors, budget))
                self.budget_held = True
        return params

    def request(self, params: SamplingParams | None = None, *, stream: bool = False) -> EngineRequest:
        """The engine request (tokenized and checked, as ``LLM.make_request``; with images, run through
        the model's processor: slow, so a server calls it off its event loop)."""
        prompt, special = self.engine_prompt()
        return self.llm.make_request(prompt, params, stream=stream, add_special_tokens=special, lora_request=self.lora_request)

    def engine_prompt(self) -> tuple[str | dict[str, Any], bool]:
        """The rendered prompt (with the images, vLLM's ``{"prompt", "multi_modal_data"}``) and whether
        the tokenizer adds its special tokens: the template writes them itself (BOS...), so not for
        text; with images, as transformers' processors decide (unless the prompt starts with BOS)."""
        text = self._rendered()
        if not self.images:
            return text, False
        return {"prompt": text, "multi_modal_data": {"image": self.images}}, processor_adds_special_tokens(text, self.llm.tokenizer)

    def read(self, out: RequestOutput) -> RequestOutput:
        """``out``'s completions with ``content``, ``reasoning_content`` and ``tool_calls`` read by the plan."""
        if self.plan.reads_calls or self.plan.reasoning is not None:
            for c in out.outputs:
                reading = self.plan.read(c.text)
                c.content, c.reasoning_content, c.tool_calls = reading.content, reading.reasoning, reading.tool_calls
        return out

    def _rendered(self) -> str:
        return self.prompt if self.prompt is not None else self.render()


def render_chat(llm: Any, messages: list[dict[str, Any]], chat_template: str | None, add_generation_prompt: bool,
                continue_final_message: bool, chat_template_kwargs: dict[str, Any] | None,
                tools: list[dict[str, Any]] | None) -> str:
    """``LLM.render_chat``: the conversation through the tokenizer's ``apply_chat_template``."""
    tok = llm.tokenizer
    if tok is None:
        raise RequestError(f"backend {llm.backend.name!r} was loaded without a tokenizer; pass token ids")
    if chat_template is None and not getattr(tok, "chat_template", None):
        raise RequestError(
            f"model {llm.model_config.model!r} has no chat template; pass chat_template=... "
            "(a Jinja template) or use generate()"
        )
    from lmdock.tools import template_messages

    extra = {"tools": tools} if tools else {}
    try:
        return tok.apply_chat_template(  # type: ignore[no-any-return]
            template_messages(messages),
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **extra,
            **(chat_template_kwargs or {}),
        )
    except Exception as exc:
        raise RequestError(f"the chat template failed: {type(exc).__name__}: {exc}") from None


def chat_plan(llm: Any, tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, chat_template: str | None,
              chat_template_kwargs: dict[str, Any] | None) -> Any:
    """``LLM.chat_plan``: a :class:`lmdock.tools.ChatPlan` with the model's parsers."""
    from lmdock.tools import ChatPlan

    mc = llm.model_config
    template = chat_template or getattr(llm.tokenizer, "chat_template", None)
    return ChatPlan.make(tools, tool_choice, parallel_tool_calls, chat_template_kwargs, model=mc.name or mc.model,
                         tool_parser=mc.tool_parser, reasoning_parser=mc.reasoning_parser,
                         template=template if isinstance(template, str) else None)
