"""lmdock-hf's image side beyond the conformance suite's exact tokens (lmdock_conformance.test_vision):
a second turn over the same image runs the vision tower once; Qwen2-VL's multimodal rotary positions
through the prefix cache, forks and prefill chunks that cut an image apart; Gemma 3's bidirectional
image tokens through prefill chunks that would cut them apart (prompt logprobs too); bad images are
refused from the header with nothing held afterwards; image prompts of one step share one vision
tower run and still give transformers' tokens."""

from __future__ import annotations

import io
import shutil
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lmdock import LLM, RequestError, UnsupportedError
from lmdock._llm.multimodal import ImageLimits, load_image
from lmdock_conformance.zoo_vision import FAMILIES, PLACEHOLDERS, build, load_processor, seeded_image
from lmdock_hf._tower import JOIN, groups, join
from lmdock_hf._vision import SINCE, _version

GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
TEXT = {"vocab_size": 520, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with LLM(str(build("llava", tmp_path_factory.mktemp("llava"))), backend="hf") as llm:
        yield llm


def test_second_turn_reuses_the_encoded_image(llava: Any) -> None:
    """The same image in a longer second-turn prompt: the vision tower does not run again, and the
    prompt's first turn comes from the prefix cache (keyed by the image's hash)."""
    image = seeded_image(21)
    vision = llava.engine.engine.vision
    first = llava.generate({"prompt": "Once upon a time <image> there", "multi_modal_data": {"image": image}}, GREEDY)[0]
    runs = vision.encodes
    second = llava.generate({"prompt": "Once upon a time <image> there was a girl", "multi_modal_data": {"image": image}}, GREEDY)[0]
    assert vision.encodes == runs
    assert second.num_cached_tokens > 0 and first.outputs[0].token_ids
    llava.generate({"prompt": "Once upon a time <image> there", "multi_modal_data": {"image": seeded_image(22)}}, GREEDY)
    assert vision.encodes == runs + 1  # another image is encoded


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str] | None]:
    """lmdock-hf on the tiny Qwen2-VL; None before transformers 5.24 (see :func:`_refused_here`)."""
    if _version() < SINCE["qwen2_vl"]:
        yield None
        return
    path = str(build("qwen2_vl", tmp_path_factory.mktemp("qwen2_vl")))
    with LLM(path, backend="hf") as llm:
        yield llm, path


def _refused_here(family: str, stories: str, tmp_path: Path) -> bool:
    """Before the transformers release lmdock-hf runs ``family`` from, it refuses it at load, saying
    so: assert that (on a model built from its config: the zoo builds from that release on) and
    return True; else False."""
    import transformers

    if _version() >= SINCE[family]:
        return False
    if family == "qwen2_vl":
        cfg = transformers.Qwen2VLConfig(text_config={**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}},
                                         vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2})
        model = transformers.Qwen2VLForConditionalGeneration(cfg)
    else:
        cfg = transformers.Gemma3Config(text_config=TEXT, mm_tokens_per_image=4, vision_config={
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14})
        model = transformers.Gemma3ForConditionalGeneration(cfg)
    path = _save_with_tokenizer(model, tmp_path / family, stories)
    with pytest.raises(UnsupportedError, match=f"{family}.*upgrade transformers"):
        LLM(path, backend="hf")
    return True


def _transformers(path: str, prompt: str, images: list[Any] | None) -> list[int]:
    """transformers' greedy tokens (``generate`` on the model's processor's outputs)."""
    import torch
    from transformers import AutoModelForImageTextToText

    inputs = load_processor(path)(text=[prompt], images=images, return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=GREEDY["max_tokens"], do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_qwen2_vl_second_turn_from_the_prefix_cache(qwen: tuple[Any, str] | None, stories: str, tmp_path: Path) -> None:
    """Qwen2-VL's multimodal rotary positions survive the prefix cache: a longer second turn over the
    same image reuses the first turn's KV state (image tokens at their grid positions) and its new
    tokens, at index + the image's offset, give transformers' tokens."""
    if _refused_here("qwen2_vl", stories, tmp_path):
        return
    assert qwen is not None
    llm, path = qwen
    image = seeded_image(31, (60, 40))
    first = f"Once upon a time {PLACEHOLDERS['qwen2_vl']} there"
    llm.generate({"prompt": first, "multi_modal_data": {"image": image}}, GREEDY)
    second = llm.generate({"prompt": first + " was a girl", "multi_modal_data": {"image": image}}, GREEDY)[0]
    assert second.num_cached_tokens > 0
    assert list(second.outputs[0].token_ids) == _transformers(path, first + " was a girl", [image])


def test_qwen2_vl_forked_samples_keep_the_offset(qwen: tuple[Any, str] | None, stories: str, tmp_path: Path) -> None:
    """``n=2`` greedy samples of one image prompt: both decode at the prompt's positions (a fork carries the offset)."""
    if _refused_here("qwen2_vl", stories, tmp_path):
        return
    assert qwen is not None
    llm, path = qwen
    image = seeded_image(32)
    prompt = f"Once {PLACEHOLDERS['qwen2_vl']} upon a time"
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, {**GREEDY, "n": 2})[0]
    want = _transformers(path, prompt, [image])
    assert [list(o.token_ids) for o in out.outputs] == [want, want]


def test_qwen2_vl_image_split_across_prefill_chunks(qwen: tuple[Any, str] | None, stories: str, tmp_path: Path) -> None:
    """Prefill chunks of 4 tokens cut the image's tokens apart: each chunk takes its own slice of
    the prompt's 3-D positions (and of the image features)."""
    if _refused_here("qwen2_vl", stories, tmp_path):
        return
    assert qwen is not None
    path = qwen[1]
    image = seeded_image(33, (60, 40))
    prompt = f"Once upon a time {PLACEHOLDERS['qwen2_vl']} there was"
    with LLM(path, backend="hf", max_num_batched_tokens=4) as llm:
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, GREEDY)[0]
    assert list(out.outputs[0].token_ids) == _transformers(path, prompt, [image])


#: the families whose tower inputs concatenate across requests (``lmdock_hf._tower.JOIN``), as the zoo builds them here
BATCHED = sorted(f for f in FAMILIES if f in JOIN)


@pytest.mark.parametrize("family", BATCHED)
def test_one_tower_run_for_a_step_of_image_prompts(family: str, tmp_path: Path) -> None:
    """Three prompts with different images (one with two, of other sizes) and a text-only one, in one
    ``generate``: their prefill chunks share a step, the vision tower runs fewer times than there are
    image prompts, and each prompt's greedy tokens are transformers' own for that prompt alone."""
    path = str(build(family, tmp_path / family))
    image = PLACEHOLDERS[family]
    prompts = [(f"Once upon a time {image} there", [seeded_image(41)]),
               (f"Once {image} upon a time {image} there was", [seeded_image(42, (60, 40)), seeded_image(43)]),
               ("Once upon a time there was a little girl", []),
               (f"A girl {image} and a", [seeded_image(44, (30, 50))])]
    with LLM(path, backend="hf") as llm:
        vision = llm.engine.engine.vision
        outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": ims}} if ims else p for p, ims in prompts], GREEDY)
        assert 0 < vision.encodes < 3
    assert [list(o.outputs[0].token_ids) for o in outs] == [_transformers(path, p, ims or None) for p, ims in prompts]


def test_tower_groups_join_only_what_concatenates() -> None:
    """Idefics3's images join along the image axis only at one height and width; inputs with a key
    the family's rule does not know run alone; a family without a rule runs each request alone."""
    import torch

    def idefics(images: int, side: int) -> dict[str, Any]:
        return {"pixel_values": torch.zeros(1, images, 3, side, side), "pixel_attention_mask": torch.ones(1, images, side, side, dtype=torch.long)}

    inputs = [idefics(5, 28), idefics(2, 28), idefics(5, 56), idefics(1, 28)]
    assert groups("idefics3", inputs) == [[0, 1, 3], [2]]
    joined = join("idefics3", [inputs[0], inputs[1]])
    assert joined["pixel_values"].shape == (1, 7, 3, 28, 28) and joined["pixel_attention_mask"].shape == (1, 7, 28, 28)
    qwen = [{"pixel_values": torch.zeros(24, 1176), "image_grid_thw": torch.tensor([[1, 4, 6]])},
            {"pixel_values": torch.zeros(48, 1176), "image_grid_thw": torch.tensor([[1, 4, 6], [1, 4, 6]])},
            {"pixel_values": torch.zeros(24, 1176), "image_grid_thw": torch.tensor([[1, 4, 6]]), "num_crops": torch.tensor([0])}]
    assert groups("qwen2_vl", qwen) == [[0, 1], [2]]
    assert join("qwen2_vl", qwen[:2])["image_grid_thw"].tolist() == [[1, 4, 6]] * 3
    assert groups("llava_next", [{"pixel_values": torch.zeros(1, 3, 28, 28)}] * 2) == [[0], [1]]


def test_a_text_model_given_an_image_is_refused(llm: Any) -> None:
    with pytest.raises(RequestError, match="no vision encoder"):
        llm.generate({"prompt": "Once upon a time", "multi_modal_data": {"image": seeded_image(1)}}, GREEDY)


def test_token_id_prompts_cannot_carry_images(llava: Any) -> None:
    with pytest.raises(RequestError, match="must be text"):
        llava.generate({"prompt_token_ids": [1, 403, 512], "multi_modal_data": {"image": seeded_image(1)}}, GREEDY)


def _save_with_tokenizer(model: Any, target: Path, stories: str) -> str:
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(stories) / name).is_file():
            shutil.copy(Path(stories) / name, target / name)
    return str(target)


def test_a_family_not_held_to_transformers_is_refused_at_load(stories: str, tmp_path: Path) -> None:
    """LLaVA-NeXT (image tiles, newline features) has no conformance test on lmdock-hf: refused, saying why."""
    import transformers

    tower = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    cfg = transformers.LlavaNextConfig(text_config={**TEXT, "model_type": "llama"}, vision_config={**tower, "model_type": "clip_vision_model"},
                                       image_grid_pinpoints=[[28, 28]], image_token_id=512)
    path = _save_with_tokenizer(transformers.LlavaNextForConditionalGeneration(cfg), tmp_path / "llava_next", stories)
    with pytest.raises(UnsupportedError, match="llava_next.*not checked against transformers"):
        LLM(path, backend="hf")


def test_gemma3_image_split_across_prefill_chunks(stories: str, tmp_path: Path) -> None:
    """Gemma 3's image tokens attend to each other both ways: prefill chunks of 3 tokens would cut the
    image (4 tokens) apart, so lmdock-hf runs on to the image's end.  Greedy tokens and every prompt
    logprob equal transformers' (its forward over the whole prompt, where the image's tokens see each other)."""
    if _refused_here("gemma3", stories, tmp_path):
        return
    import torch
    from transformers import AutoModelForImageTextToText

    path = str(build("gemma3", tmp_path / "gemma3"))
    image = seeded_image(34)
    prompt = f"Once upon a time {PLACEHOLDERS['gemma3']} there was"
    with LLM(path, backend="hf", max_num_batched_tokens=3) as llm:
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, {**GREEDY, "prompt_logprobs": 0})[0]
    assert list(out.outputs[0].token_ids) == _transformers(path, prompt, [image])
    inputs = load_processor(path)(text=[prompt], images=[image], return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(model(**inputs).logits[0].float(), dim=-1)
    ids = inputs["input_ids"][0].tolist()
    assert list(out.prompt_token_ids) == ids
    got = [next(iter(d.values())).logprob if d else None for d in out.prompt_logprobs]
    assert got[0] is None
    assert got[1:] == pytest.approx([float(want[i - 1, t]) for i, t in enumerate(ids) if i > 0], abs=1e-4)


def _png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def test_pixel_bound_is_read_from_the_header() -> None:
    """A 100x100 PNG header over a 5000-pixel bound is refused before decoding (its data is absent:
    decoding would fail differently)."""
    with pytest.raises(RequestError, match="100x100 = 10000 pixels, over the bound of 5000"):
        load_image(_png_header(100, 100), "img", ImageLimits(max_pixels=5000))
    with pytest.raises(RequestError, match="corrupt"):
        load_image(_png_header(10, 10), "img", ImageLimits(max_pixels=5000))


def test_paths_only_under_image_dir(tmp_path: Path) -> None:
    buf = io.BytesIO()
    seeded_image(3).save(buf, format="PNG")
    inside = tmp_path / "ok" / "a.png"
    inside.parent.mkdir()
    inside.write_bytes(buf.getvalue())
    (tmp_path / "b.png").write_bytes(buf.getvalue())
    limits = ImageLimits(image_dir=str(inside.parent))
    assert load_image(str(inside), "img", limits).size == (40, 30)
    with pytest.raises(RequestError, match="not under the server's image_dir"):
        load_image(str(inside.parent / ".." / "b.png"), "img", limits)
    with pytest.raises(RequestError, match="reads no image files"):
        load_image(str(inside), "img", ImageLimits(allow_paths=False))


def test_too_many_images() -> None:
    from lmdock._llm.multimodal import multimodal_data

    with pytest.raises(RequestError, match="3 images in one request; this server takes at most 2"):
        multimodal_data([seeded_image(i) for i in range(3)], "img", ImageLimits(max_images=2))
