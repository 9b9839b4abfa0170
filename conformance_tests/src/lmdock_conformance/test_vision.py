"""Images in, text out: each vision family of ``lmdock_conformance.zoo_vision`` gives transformers'
greedy tokens (``generate`` on its processor's outputs), for one and two images, batched beside a
text-only prompt, and through chat's image parts.  A backend that lacks ``vision`` skips with its
reason.  The checkpoints are built here (seconds each; torch, transformers and Pillow).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import pytest
from lmdock import RequestError

from lmdock_conformance.zoo_vision import FAMILIES, PLACEHOLDERS, build, load_processor, seeded_image

pytestmark = pytest.mark.requires("vision")

NEW = 12
GREEDY = {"max_tokens": NEW, "temperature": 0, "ignore_eos": True}
ONE = "Once upon a time <image> there was"
TWO = "Once <image> upon a time <image> there was"
TEXT = "Once upon a time there was a little girl"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def vlm(family: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build(family, tmp_path_factory.mktemp(family)))


@pytest.fixture(scope="module")
def one(family: str) -> str:
    """ONE with the family's image placeholder."""
    return ONE.replace("<image>", PLACEHOLDERS[family])


@pytest.fixture(scope="module")
def two(family: str) -> str:
    return TWO.replace("<image>", PLACEHOLDERS[family])


@pytest.fixture(scope="module")
def ref(vlm: str) -> Any:
    """transformers' greedy tokens for a prompt and its images (float32, the model's processor)."""
    import torch
    from transformers import AutoModelForImageTextToText

    processor = load_processor(vlm)
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()

    def run(text: Any, images: list[Any] | None) -> list[int]:
        """``text``: a prompt, or a conversation for the processor's apply_chat_template."""
        if not isinstance(text, str):
            inputs = processor.apply_chat_template(text, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
        elif images:
            inputs = processor(text=[text], images=images, return_tensors="pt")
        else:
            inputs = processor.tokenizer([text], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    return run


@pytest.fixture(scope="module")
def vllm_(lmdock_setup: Any, vlm: str) -> Iterator[Any]:
    from lmdock import LLM, UnsupportedError

    try:
        llm = LLM(vlm, backend=lmdock_setup.backend, **lmdock_setup.options)
    except UnsupportedError as exc:  # a family the backend refuses at load says why (lmdock-vllm without torchvision)
        if "vision-language model" not in str(exc):
            raise
        pytest.skip(f"refused at load: {exc}")
    yield llm
    llm.shutdown()


def _tokens(out: Any) -> list[int]:
    return list(out.outputs[0].token_ids)


def test_one_image_matches_transformers(vllm_: Any, ref: Any, one: str) -> None:
    image = seeded_image(1)
    out = vllm_.generate({"prompt": one, "multi_modal_data": {"image": image}}, GREEDY)
    assert _tokens(out[0]) == ref(one, [image])


def test_two_images_in_one_prompt(vllm_: Any, ref: Any, two: str) -> None:
    images = [seeded_image(2), seeded_image(3, (24, 36))]
    out = vllm_.generate({"prompt": two, "multi_modal_data": {"image": images}}, GREEDY)
    assert _tokens(out[0]) == ref(two, images)


def test_batched_beside_a_text_prompt(vllm_: Any, ref: Any, one: str) -> None:
    """Two prompts with different images and a text-only one in one batch: each as run alone."""
    a, b = seeded_image(4), seeded_image(5)
    outs = vllm_.generate([{"prompt": one, "multi_modal_data": {"image": [a]}}, TEXT,
                           {"prompt": one, "multi_modal_data": {"image": [b]}}], GREEDY)
    assert [_tokens(o) for o in outs] == [ref(one, [a]), ref(TEXT, None), ref(one, [b])]


def test_another_image_never_reuses_kv(vllm_: Any, ref: Any, one: str) -> None:
    """The same text with another image after the first (prefix caching keys images by content)."""
    a, b = seeded_image(6), seeded_image(7)
    first = vllm_.generate({"prompt": one, "multi_modal_data": {"image": [a]}}, GREEDY)
    second = vllm_.generate({"prompt": one, "multi_modal_data": {"image": [b]}}, GREEDY)
    assert _tokens(first[0]) == ref(one, [a])
    assert _tokens(second[0]) == ref(one, [b])
    assert _tokens(first[0]) != _tokens(second[0])  # the images do reach the model


def test_image_sources_agree(vllm_: Any, tmp_path: Any, one: str) -> None:
    """A PIL image, its PNG bytes, a path and a data URL are one image."""
    image = seeded_image(8)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    path = tmp_path / "i.png"
    path.write_bytes(buf.getvalue())
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    outs = vllm_.generate([{"prompt": one, "multi_modal_data": {"image": v}} for v in (image, buf.getvalue(), str(path), url)], GREEDY)
    assert len({tuple(_tokens(o)) for o in outs}) == 1


def test_chat_image_parts(vllm_: Any, ref: Any) -> None:
    """OpenAI ``image_url`` (a data URL) and transformers ``{"type": "image"}`` parts give the tokens
    of transformers' generate on the processor's own ``apply_chat_template`` of the conversation."""
    image = seeded_image(9)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    text = [{"type": "text", "text": "Once upon a time "}]
    openai = [{"role": "user", "content": [*text, {"type": "image_url", "image_url": {"url": url}}]}]
    hf = [{"role": "user", "content": [*text, {"type": "image", "image": image}]}]
    want = ref(hf, None)
    outs = [vllm_.chat(m, GREEDY)[0] for m in (openai, hf)]
    assert [_tokens(o) for o in outs] == [want, want]


@pytest.mark.parametrize(("images", "needle"), [
    ([b"not an image"], "not a decodable image"),
    (["data:image/png;base64,@@@"], "does not decode"),
    (["data:text/plain;base64,aGk="], "not an image type"),
    (["https://example.com/cat.png"], "does not fetch images"),
    (["seeded", "seeded"], "placeholder"),  # two images, one placeholder
])
def test_bad_images_are_refused(vllm_: Any, images: list[Any], needle: str, one: str) -> None:
    images = [seeded_image(10 + i) if v == "seeded" else v for i, v in enumerate(images)]
    with pytest.raises(RequestError, match=needle):
        vllm_.generate({"prompt": one, "multi_modal_data": {"image": images}}, GREEDY)
    assert vllm_.generate(TEXT, GREEDY)[0].outputs[0].token_ids  # nothing held: the engine still serves


def test_decompression_bomb_refused_before_decoding(vllm_: Any, one: str) -> None:
    """A PNG whose header says 20000x20000 pixels is refused from its header (the data is tiny)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")
    with pytest.raises(RequestError, match="too large|over the bound"):
        vllm_.generate({"prompt": one, "multi_modal_data": {"image": png}}, GREEDY)
