"""GGUF export of a vision-language model, checked in llama.cpp itself: save_gguf writes the text GGUF plus the
mmproj (fastkit/export/gguf/mmproj.py); llama.cpp's multimodal library (libmtmd) loads both, encodes an image, and
its image embeddings must match transformers' image features of the same model on the same image; the text GGUF
reproduces the model's logits in llama.cpp. Families whose mmproj fastkit does not write are refused, named.

libmtmd: llama-cpp-python built with -DLLAVA_BUILD=ON (.ci/run), or ``MTMD_CPP_LIB`` naming a folder holding
``libmtmd.so`` built from the same llama.cpp. Without it these tests skip, and fail in CI (CI=true)."""

from __future__ import annotations

import ctypes
import dataclasses
import os

import numpy as np
import pytest
import torch

from fastkit import FastModel, registry
from fastkit.errors import FastkitError
from fastkit.export import save_gguf
from fastkit.families.vision import twin_image
from tests.helpers import require_llama_cpp

EMBD_TOL = 2e-3
"""Largest |Δ| between llama.cpp's and transformers' image embeddings, over their scale (max |x|): the mmproj is
f16, the tower runs in f32 in both; measured on five images: idefics3 twin 2.3e-4 to 1.0e-3, gemma3 twin
6.1e-4 to 9.0e-4 (another image: 0.8 to 1.4)."""


def _mtmd():
    llama_cpp = require_llama_cpp()
    try:
        from llama_cpp import mtmd_cpp
    except (OSError, FileNotFoundError, RuntimeError) as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"llama.cpp's libmtmd is not loadable in CI ({exc}): .ci/run builds llama-cpp-python with "
                        "-DLLAVA_BUILD=ON")
        pytest.skip(f"llama.cpp's libmtmd is not built here ({exc}); build llama-cpp-python with "
                    "-DLLAVA_BUILD=ON or set MTMD_CPP_LIB")
    return llama_cpp, mtmd_cpp


SIZES = {"idefics3": 64, "smolvlm": 64, "gemma3": 28, "qwen2_5_vl": 224, "qwen3_vl": 128, "qwen3_vl_moe": 128}
"""Each twin's image size: an image of it passes llama.cpp's resize unchanged (Qwen: a multiple of 28 within
llama.cpp's 8 to 4096 tokens, 2x2 of its 112-pixel windows, so the windowed block differs from the full one)."""
QWEN_WINDOW = 112
"""The window llama.cpp's qwen2.5vl_merger computes (Qwen2.5-VL's window_size); the twin's 56 is refused."""
QWEN_EPS = 1e-6
"""Qwen2.5-VL's text ``rms_norm_eps``. llama.cpp's qwen2vl graph (llama-cpp-python 0.3.36) reads no epsilon key and
norms with 0: at 1e-6 that is below f16's rounding (logits 2.3e-3 of their scale), at the twin's 1e-5 on its tiny
hidden states it would be 1.3e-2 (the same file under llama.cpp's qwen2 graph: 1.7e-3)."""


def _tuned(model_type: str):
    vision = {"vision": True} if registry.MODEL_TABLE[model_type].text_config else {}
    model, processor = FastModel.from_pretrained(model_type, twin=True, max_seq_length=256, dtype="fp32", **vision)
    if model_type == "qwen2_5_vl":  # Qwen2.5-VL's window (the twin's 56 covers its whole 56-pixel images), its eps
        model.config.vision_config.window_size = model.model.visual.window_size = QWEN_WINDOW
        model.config.text_config.rms_norm_eps = QWEN_EPS
        for module in model.model.language_model.modules():
            if hasattr(module, "variance_epsilon"):
                module.variance_epsilon = QWEN_EPS
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False, finetune_vision_layers=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter on the tower and the language model: non-zero B
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval(), processor


@pytest.fixture(scope="module", params=["idefics3", "smolvlm", "gemma3", "qwen2_5_vl", "qwen3_vl",
                                                  "qwen3_vl_moe"])
def exported(request, tmp_path_factory):
    model, processor = _tuned(request.param)
    out = tmp_path_factory.mktemp(request.param)
    text = save_gguf(model, processor, out, quantization="f16")
    mmproj = text.replace("-f16.gguf", "-mmproj-f16.gguf")
    assert os.path.exists(mmproj)
    return request.param, model, processor, text, mmproj


def _hf_features(model_type: str, model, processor, image) -> np.ndarray:
    """transformers' image features (after the projector), (tokens, H), preprocessed by the family's processor."""
    side = image.size[0]
    qwen = model_type.startswith("qwen")
    size = {"size": {"shortest_edge": side * side, "longest_edge": side * side}} if qwen else {}
    batch = processor.image_processor(images=[image], return_tensors="pt", **size)  # Qwen: this size, unresized
    vlm = model.get_base_model().model
    with torch.no_grad():
        if qwen:
            out = vlm.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
        elif model_type == "gemma3":
            out = vlm.get_image_features(batch["pixel_values"])
        else:
            out = vlm.get_image_features(batch["pixel_values"], batch["pixel_attention_mask"])
    features = torch.cat([f.reshape(-1, f.shape[-1]) for f in out.pooler_output])  # (tokens, H)
    deepstack = [torch.cat(list(level)) for level in getattr(out, "deepstack_features", None) or ()]
    return torch.cat([features, *deepstack], dim=-1).numpy()  # Qwen3-VL: (tokens, H·(1 + deepstack mergers))


def _mtmd_embeddings(text_file: str, mmproj_file: str, image) -> list[np.ndarray]:
    """llama.cpp's image embeddings, one (tokens, H) array per image chunk: its preprocessing, its graph."""
    llama_cpp, mtmd = _mtmd()
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(text_file.encode(), params)
    assert model, "llama.cpp did not load the text GGUF"
    ctx_params = mtmd.mtmd_context_params_default()
    ctx_params.use_gpu, ctx_params.n_threads, ctx_params.warmup = False, 1, False
    ctx = mtmd.mtmd_init_from_file(mmproj_file.encode(), model, ctx_params)
    assert ctx, "llama.cpp's mtmd did not load the mmproj"
    try:
        rgb = np.asarray(image.convert("RGB"), dtype=np.uint8)  # (H, W, 3)
        data = (ctypes.c_uint8 * rgb.size).from_buffer_copy(rgb.tobytes())
        bitmap = mtmd.mtmd_bitmap_init(rgb.shape[1], rgb.shape[0], data)
        chunks = mtmd.mtmd_input_chunks_init()
        prompt = b"User:" + mtmd.mtmd_default_marker() + b"What is it?"
        text = mtmd.mtmd_input_text(prompt, len(prompt), True, True)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
        images = [mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))]
        images = [c for c in images if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE]
        n_embd, out = llama_cpp.llama_model_n_embd_inp(model), []  # Qwen3-VL: H·(1 + deepstack mergers)
        for chunk in images:  # idefics3: the overview, then each tile
            assert mtmd.mtmd_encode_chunk(ctx, chunk) == 0
            n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            embd = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n_tokens * n_embd,))
            out.append(embd.reshape(n_tokens, n_embd).copy())  # (tokens, H)
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        return out
    finally:
        mtmd.mtmd_free(ctx)
        llama_cpp.llama_model_free(model)


def test_llama_cpp_mtmd_encodes_an_image_as_transformers_does(exported):
    model_type, model, processor, text_file, mmproj_file = exported
    image = twin_image(3, size=(SIZES[model_type],) * 2)  # the twin's image size: llama.cpp's resize is the identity
    want = _hf_features(model_type, model, processor, image)  # (4, H) (idefics3, gemma3), (64, H) (qwen2_5_vl)
    got = _mtmd_embeddings(text_file, mmproj_file, image)
    # idefics3's preprocessing in llama.cpp: the overview and one tile (both the image itself here); the others': one
    assert [part.shape for part in got] == [want.shape] * (2 if model_type in ("idefics3", "smolvlm") else 1)
    other = _hf_features(model_type, model, processor, twin_image(4, size=image.size))  # another image: far
    for part in got:
        err = np.abs(part - want).max() / np.abs(want).max()
        assert err < EMBD_TOL, f"llama.cpp's image embeddings are {err:.3g} of their scale away from transformers'"
        assert np.abs(part - other).max() / np.abs(other).max() > 0.1


def _mtmd_prompt_logits(text_file: str, mmproj_file: str, image) -> tuple[list[int], np.ndarray]:
    """llama.cpp answering an image prompt: libmtmd tokenizes it (its image markers, its image token count), encodes
    the image and decodes everything at its positions (Qwen: mrope's 3-D ones). Returns the prompt as token ids
    (the image as that many image placeholders, for transformers) and llama.cpp's last-token logits."""
    llama_cpp, mtmd = _mtmd()
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(text_file.encode(), llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = 256
    params.n_threads = params.n_threads_batch = 1
    lctx = llama_cpp.llama_init_from_model(model, params)
    ctx_params = mtmd.mtmd_context_params_default()
    ctx_params.use_gpu, ctx_params.n_threads, ctx_params.warmup = False, 1, False
    ctx = mtmd.mtmd_init_from_file(mmproj_file.encode(), model, ctx_params)
    assert model and lctx and ctx, "llama.cpp did not load the GGUF pair"
    try:
        rgb = np.asarray(image.convert("RGB"), dtype=np.uint8)  # (H, W, 3)
        bitmap = mtmd.mtmd_bitmap_init(rgb.shape[1], rgb.shape[0],
                                       (ctypes.c_uint8 * rgb.size).from_buffer_copy(rgb.tobytes()))
        chunks = mtmd.mtmd_input_chunks_init()
        prompt = b"User: " + mtmd.mtmd_default_marker() + b" What is in the picture?\nAssistant:"
        text = mtmd.mtmd_input_text(prompt, len(prompt), False, True)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
        ids = _chunk_ids(mtmd, chunks)
        n_past = llama_cpp.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(ctx, lctx, chunks, 0, 0, 256, True, ctypes.byref(n_past)) == 0
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lctx, -1), shape=(n_vocab,)).copy()
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        return ids, logits
    finally:
        mtmd.mtmd_free(ctx)
        llama_cpp.llama_free(lctx)
        llama_cpp.llama_model_free(model)


def _chunk_ids(mtmd, chunks) -> list[int]:
    """The tokenized prompt's ids, an image chunk as -1 once per image token."""
    ids = []
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            ids += [-1] * mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            continue
        n = ctypes.c_size_t()
        tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
        ids += [tokens[j] for j in range(n.value)]
    return ids


@pytest.mark.parametrize("exported", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"], indirect=True)  # mrope: 3-D
def test_llama_cpp_answers_an_image_prompt_as_transformers_does(exported):
    """Image embeddings, their place in the prompt and the language model's mrope positions together: llama.cpp's
    next-token logits after an image prompt are transformers' (their 1-D positions would be 0.11 away)."""
    model_type, model, processor, text_file, mmproj_file = exported
    image = twin_image(3, size=(SIZES[model_type],) * 2)
    ids, got = _mtmd_prompt_logits(text_file, mmproj_file, image)
    image_id = model.config.image_token_id
    ids = torch.tensor([[image_id if t == -1 else t for t in ids]])  # (1, T)
    side = SIZES[model_type] ** 2
    batch = processor.image_processor(images=[image], return_tensors="pt",
                                      size={"shortest_edge": side, "longest_edge": side})
    assert (ids == image_id).sum() == batch["image_grid_thw"].prod() // 4  # llama.cpp's image tokens: the 2x2 merges
    with torch.no_grad():
        want = model(input_ids=ids, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                     mm_token_type_ids=(ids == image_id).long()).logits[0, -1].numpy()
    err = np.abs(got - want).max() / np.abs(want).max()  # measured 3.5e-3 (f16 weights, tower and language model)
    assert err < 5e-3, f"llama.cpp's logits after the image are {err:.3g} of their scale away from transformers'"


def test_the_text_gguf_reproduces_the_language_model_in_llama_cpp(exported):
    from fastkit.export.gguf import llamacpp

    require_llama_cpp()
    _, model, processor, text_file, _ = exported
    ids = processor.tokenizer("User: What is in the picture?\nAssistant:")["input_ids"]
    llm = llamacpp.load(text_file, "the text GGUF", n_ctx=64, logits_all=True, n_threads=1)
    llm.eval(ids)
    got = np.asarray(llm.scores[: len(ids)])
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    err = np.abs(got - want).max() / np.abs(want).max()  # f16 weights; measured 8.8e-4 (idefics3), 2.2e-3 (gemma3)
    assert err < 5e-3, f"llama.cpp's logits are {err:.3g} of their scale away from transformers'"


def test_a_vision_family_without_an_mmproj_writer_gets_no_text_only_gguf(monkeypatch, tmp_path):
    """A vision row fastkit writes no mmproj for is refused: a text-only GGUF would drop the tuned vision."""
    from fastkit.export.gguf import mmproj

    assert set(mmproj.PROJECTORS) == {t for t, f in registry.MODEL_TABLE.items() if f.vision}  # every row, today
    row = registry.MODEL_TABLE["qwen3_vl_moe"]  # as a vision row added without its projector would be
    monkeypatch.setitem(registry.MODEL_TABLE, "qwen3_vl_moe",
                        dataclasses.replace(row, vision=dataclasses.replace(row.vision, gguf_projector="")))
    model, processor = FastModel.from_pretrained("qwen3_vl_moe", twin=True, max_seq_length=256)
    with pytest.raises(FastkitError, match="no GGUF mapping"):
        save_gguf(model, processor, tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()


@pytest.mark.parametrize(("key", "value"), [("fullatt_block_indexes", [0]), ("fullatt_block_indexes", []),
                                          ("hidden_act", "gelu"), ("temporal_patch_size", 3)])
def test_a_qwen2_5_vl_tower_llama_cpp_computes_otherwise_is_refused_before_writing(key, value, tmp_path):
    model, processor = FastModel.from_pretrained("qwen2_5_vl", twin=True, max_seq_length=256)
    model.config.vision_config.window_size = QWEN_WINDOW
    setattr(model.config.vision_config, key, value)  # depth 2: [0] would be full attention in both blocks
    with pytest.raises(FastkitError, match=key):
        save_gguf(model, processor, tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()


@pytest.mark.parametrize(("model_type", "interleaved"), [("qwen2_5_vl", True), ("qwen3_vl", False)])
def test_mrope_sections_llama_cpp_orders_otherwise_are_refused_before_writing(model_type, interleaved, tmp_path):
    """llama.cpp's qwen2vl ropes the sections in order, its qwen3vl interleaved (as each family's transformers)."""
    model, processor = FastModel.from_pretrained(model_type, twin=True, max_seq_length=256)
    if model_type == "qwen2_5_vl":
        model.config.vision_config.window_size = QWEN_WINDOW
    model.config.text_config.rope_parameters["mrope_interleaved"] = interleaved
    with pytest.raises(FastkitError, match="mrope_interleaved"):
        save_gguf(model, processor, tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()


def test_a_tokenizer_instead_of_the_processor_is_refused_before_writing(tmp_path):
    model, processor = FastModel.from_pretrained("idefics3", twin=True, max_seq_length=256)
    with pytest.raises(FastkitError, match="processor"):
        save_gguf(model, processor.tokenizer, tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()


def test_a_4bit_vision_model_is_refused_before_writing(tmp_path):
    model, processor = FastModel.from_pretrained("idefics3", twin=True, max_seq_length=256)
    model.is_loaded_in_4bit = True  # what a bitsandbytes load sets
    with pytest.raises(FastkitError, match="4/8-bit"):
        save_gguf(model, processor, tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()
