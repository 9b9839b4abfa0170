"""Images through ``lmdock serve`` (docs/vision.md): the openai client's chat ``image_url`` and
Responses ``input_image`` parts and the anthropic client's ``image`` blocks give transformers' greedy
text on a tiny LLaVA (lmdock_conformance.zoo_vision); bad images, too many images, a text model given
one and file paths outside ``[server] image_dir`` are 400s naming what is wrong, with nothing held.  With
``[server] image_fetch`` on, an http URL is fetched (from a 127.0.0.1 server, allowed through
``image_fetch_allow``), and one to a private address or over ``image_fetch_max_bytes`` is a 400
(the fetcher's bounds in detail, and the default off: core/tests_serve/test_image_fetch.py)."""

from __future__ import annotations

import base64
import http.server
import io
import threading
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
             'trust_request_chat_template = true\nimage_fetch = true\nimage_fetch_allow = ["127.0.0.1/32"]\n'
             'image_fetch_max_bytes = 20000\n')
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


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    """An http server on 127.0.0.1 with /small.png (seeded image 39) and /big.png (over 20000 bytes)."""
    files = {"/small.png": _png(seeded_image(39)), "/big.png": _png(seeded_image(40, (120, 100)))}
    assert len(files["/big.png"]) > 20000

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = files.get(self.path, b"")
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


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


def test_an_http_url_is_fetched(vserver: Server, expected: Any, origin: str) -> None:
    out = _chat(vserver, [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": f"{origin}/small.png"}}])
    assert out.choices[0].message.content == expected(seeded_image(39))


def test_detail_low_bounds_the_image_to_512(vserver: Server, expected: Any) -> None:
    """OpenAI's ``detail: "low"``: the model sees the image bounded to 512x512 (PIL's thumbnail,
    aspect kept); ``"high"`` feeds it as sent.  A 600x60 image whose two sizes give other text."""
    from PIL import Image

    image = seeded_image(41, (600, 60))
    low = image.copy()
    low.thumbnail((512, 512), Image.Resampling.BICUBIC)
    assert low.size == (512, 51) and expected(low) != expected(image)
    for detail, want in (("low", low), ("high", image)):
        out = _chat(vserver, [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": _url(image), "detail": detail}}])
        assert out.choices[0].message.content == expected(want), detail


def test_a_file_under_image_dir(vserver: Server, expected: Any) -> None:
    image = seeded_image(34)
    path = vserver.images / "a.png"  # type: ignore[attr-defined]
    path.write_bytes(_png(image))
    out = _chat(vserver, [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": f"file://{path}"}}])
    assert out.choices[0].message.content == expected(image)


@pytest.mark.parametrize(("content", "needle"), [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}], "not a decodable image"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,###"}}], "does not decode"),
    ([{"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}}], "private, loopback or reserved"),
    ([{"type": "image_url", "image_url": {"url": "http://127.0.0.2:9/a.png"}}], "image_fetch_allow"),
    ([{"type": "image_url", "image_url": {"url": "origin/big.png"}}], "over [server] image_fetch_max_bytes (20000 bytes)"),
    ([{"type": "image_url", "image_url": {"url": "/etc/hostname"}}], "not under the server's image_dir"),
    ([{"type": "image_url", "image_url": {"url": "big"}}], "over the bound of 40000"),
    ([{"type": "image_url", "image_url": {"url": "small"}}] * 3, "at most 2"),
    ([{"type": "image_url", "image_url": {"url": "small", "detail": "medium"}}], "detail 'medium'"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "input_audio"),
])
def test_bad_images_are_400s(vserver: Server, origin: str, content: list[Any], needle: str) -> None:
    """Undecodable data, http(s) URLs to private addresses or over [server] image_fetch_max_bytes, paths outside [server] image_dir, an image over [server]
    max_image_pixels, more than [server] max_images_per_request images, OpenAI's detail and a
    non-image part: each a 400 naming it."""
    for part in content:
        url = part.get("image_url", {}).get("url")
        if url in ("big", "small"):
            part["image_url"] = {**part["image_url"], "url": _url(seeded_image(35, (400, 300) if url == "big" else (20, 20)))}
        elif isinstance(url, str) and url.startswith("origin/"):
            part["image_url"] = {"url": f"{origin}/{url[7:]}"}
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
