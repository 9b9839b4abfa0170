"""Images through ``lmdock serve`` (docs/vision.md): the openai client's chat ``image_url`` and
Responses ``input_image`` parts and the anthropic client's ``image`` blocks give transformers' greedy
text on a tiny LLaVA (lmdock_conformance.zoo_vision); bad images, too many images, a text model given
one and file paths outside ``[server] image_dir`` are 400s naming what is wrong, with nothing held."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from lmdock_conformance.zoo_vision import build, seeded_image
from serve_helpers import Server

NEW = 10
PROMPT = "Once upon a time "


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _url(image: Any) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image)).decode()


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build("llava", tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="module")
def vserver(tmp_path_factory: pytest.TempPathFactory, llava: str) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("vision")
    (tmp / "images").mkdir()
    extra = f'[models.llava]\nmodel = "{llava}"\nbackend = "hf"\n[models.llava.sampling]\ntemperature = 0.0\n'
    table = (f'image_dir = "{tmp / "images"}"\nmax_images_per_request = 2\nmax_image_pixels = 40000\nmax_body_bytes = 4194304\n'
             'trust_request_chat_template = true\n')
    s = Server(tmp, table, args=("--model", "stories", "--model", "llava"), extra_models=extra)
    s.images = tmp / "images"  # type: ignore[attr-defined]
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected(llava: str) -> Any:
    """transformers' greedy text for a user turn ``PROMPT`` + one image, through the processor's template."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(llava)
    model = AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32).eval()

    def run(image: Any) -> str:
        conv = [{"role": "user", "content": [{"type": "text", "text": PROMPT}, {"type": "image", "image": image}]}]
        inputs = processor.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=2, pad_token_id=0)
        return str(processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))

    return run


def _chat(server: Server, content: list[Any], model: str = "llava") -> Any:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], max_tokens=NEW,
                                          temperature=0)


def test_openai_chat_image_url(vserver: Server, expected: Any) -> None:
    image = seeded_image(31)
    out = _chat(vserver, [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": _url(image)}}])
    assert out.choices[0].message.content == expected(image)


def test_openai_responses_input_image(vserver: Server, expected: Any) -> None:
    image = seeded_image(32)
    client = openai.OpenAI(base_url=f"{vserver.url}/v1", api_key="x", max_retries=0)
    out = client.responses.create(model="llava", max_output_tokens=NEW, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": PROMPT}, {"type": "input_image", "image_url": _url(image)}]}])
    assert out.output_text == expected(image)


def test_anthropic_image_block(vserver: Server, expected: Any) -> None:
    image = seeded_image(33)
    client = anthropic.Anthropic(base_url=vserver.url, api_key="x", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(_png(image)).decode()}
    out = client.messages.create(model="llava", max_tokens=NEW, messages=[  # greedy: the model's sampling table
        {"role": "user", "content": [{"type": "text", "text": PROMPT}, {"type": "image", "source": source}]}])
    assert out.content[0].text == expected(image)


def test_count_tokens_expands_the_image(vserver: Server, llava: str) -> None:
    """``/v1/messages/count_tokens`` counts the image's tokens as the model's processor expands them."""
    from transformers import AutoProcessor

    image = seeded_image(38)
    conv = [{"role": "user", "content": [{"type": "text", "text": PROMPT}, {"type": "image", "image": image}]}]
    want = AutoProcessor.from_pretrained(llava).apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)
    client = anthropic.Anthropic(base_url=vserver.url, api_key="x", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(_png(image)).decode()}
    n = client.messages.count_tokens(model="llava", messages=[
        {"role": "user", "content": [{"type": "text", "text": PROMPT}, {"type": "image", "source": source}]}])
    assert n.input_tokens == len(want["input_ids"][0]) > 4  # the 4 image tokens are in it


def test_a_file_under_image_dir(vserver: Server, expected: Any) -> None:
    image = seeded_image(34)
    path = vserver.images / "a.png"  # type: ignore[attr-defined]
    path.write_bytes(_png(image))
    out = _chat(vserver, [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": f"file://{path}"}}])
    assert out.choices[0].message.content == expected(image)


@pytest.mark.parametrize(("content", "needle"), [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}], "not a decodable image"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,###"}}], "does not decode"),
    ([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}], "does not fetch images"),
    ([{"type": "image_url", "image_url": {"url": "/etc/hostname"}}], "not under the server's image_dir"),
    ([{"type": "image_url", "image_url": {"url": "big"}}], "over the bound of 40000"),
    ([{"type": "image_url", "image_url": {"url": "small"}}] * 3, "at most 2"),
    ([{"type": "image_url", "image_url": {"url": "small", "detail": "high"}}], "detail"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "input_audio"),
])
def test_bad_images_are_400s(vserver: Server, content: list[Any], needle: str) -> None:
    """Undecodable data, http(s) URLs, paths outside [server] image_dir, an image over [server]
    max_image_pixels, more than [server] max_images_per_request images, OpenAI's detail and a
    non-image part: each a 400 naming it."""
    for part in content:
        url = part.get("image_url", {}).get("url")
        if url in ("big", "small"):
            part["image_url"] = {**part["image_url"], "url": _url(seeded_image(35, (400, 300) if url == "big" else (20, 20)))}
    r = httpx.post(f"{vserver.url}/v1/chat/completions", timeout=60, json={
        "model": "llava", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi "}, *content]}]})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_a_text_model_given_an_image_is_a_400(vserver: Server) -> None:
    r = httpx.post(f"{vserver.url}/v1/chat/completions", timeout=60, json={
        "model": "stories", "max_tokens": 4, "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.role }}{% endfor %}",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hi "}, {"type": "image_url", "image_url": {"url": _url(seeded_image(36))}}]}]})
    assert r.status_code == 400, r.text
    assert "no vision encoder" in r.json()["error"]["message"]


def test_nothing_held_after_bad_images(vserver: Server) -> None:
    """After the 400s, a good request still runs (no admission place, KV slot or model hold leaked)."""
    out = _chat(vserver, [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": _url(seeded_image(37))}}])
    assert out.choices[0].message.content
    stats = httpx.get(f"{vserver.url}/stats", timeout=5).json()["llava"]
    assert (stats["in_flight"], stats["num_sequences_held"], stats["num_requests_running"]) == (0, 0, 0)
