"""Our vision towers against transformers' `get_image_features` on the same weights (for
Qwen3-VL, the DeepStack features too: we cache them beside the main embeddings)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from mmserve.config import ExecutionConfig
from mmserve.models.registry import load_model_config
from mmserve.testing.reference import synthetic_image
from mmserve.worker.kernel_plan import load_planned_model

CPU = torch.device("cpu")

# (width, height): square, landscape, portrait, extreme strips, minimum size, the max_pixels cap
SIZES = [(224, 224), (300, 200), (150, 450), (28, 560), (900, 30), (56, 56), (1000, 800)]


def built_model(config, attention_backend: str):
    """The model loaded with the kernels `attention_backend` implies, as a worker builds it."""
    return load_planned_model(config, CPU, ExecutionConfig(attention_backend=attention_backend), 16)[0]


@pytest.fixture(scope="module", params=["torch", "cpu"])
def towers(model_dir, request):
    """Both CPU kernel sets: the torch reference and the C++ kernels."""
    ref = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = load_model_config(model_dir, dtype="float32")
    ours = built_model(config, request.param)
    return ref, ours, Qwen2VLImageProcessorPil.from_pretrained(model_dir)


@torch.inference_mode()
@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_vision_tower_matches_transformers(towers, size):
    ref, ours, processor = towers
    inputs = processor(images=[synthetic_image(*size, seed=sum(size))], return_tensors="pt")
    grid = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    features = ref.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    deepstack = [f[0] for f in getattr(features, "deepstack_features", None) or []]
    want = torch.cat([features.pooler_output[0], *deepstack], dim=-1)
    [got] = ours.encode_images([inputs["pixel_values"]], grid)
    assert got.shape == want.shape
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


@torch.inference_mode()
def test_one_frame_pixels_give_the_repeated_frames_embeddings_to_the_bit(towers):
    """The preprocessing pool writes a still image's frame once ([N, C·P·P]); the patch
    projection repeats it over T as transformers' processor does, so nothing differs."""
    _, ours, processor = towers
    inputs = processor(images=[synthetic_image(300, 200, seed=5)], return_tensors="pt")
    grid = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    rows, temporal = inputs["pixel_values"].shape[0], processor.temporal_patch_size
    one_frame = inputs["pixel_values"].view(rows, 3, temporal, -1)[:, :, 0].reshape(rows, -1)
    [want] = ours.encode_images([inputs["pixel_values"]], grid)
    [got] = ours.encode_images([one_frame], grid)
    assert torch.equal(got, want)


@torch.inference_mode()
def test_several_images_in_one_call_equal_one_at_a_time(towers):
    """Images packed into one vision-tower call must not attend to each other."""
    _, ours, processor = towers
    images = [synthetic_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES[:4])]
    inputs = processor(images=images, return_tensors="pt")
    grid = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    together = ours.encode_images([inputs["pixel_values"]], grid)
    for image, emb in zip(images, together):
        single = processor(images=[image], return_tensors="pt")
        [alone] = ours.encode_images([single["pixel_values"]], [tuple(single["image_grid_thw"][0].tolist())])
        torch.testing.assert_close(emb, alone, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_bf16_tower_computes_in_float32_where_that_is_faster(model_dir):
    """load_model: where float32 outruns bfloat16 (AVX512-BF16 without AMX) a bf16 model's tower
    is float32; either way its embeddings come out in bfloat16, within bf16 resolution of the
    float32 tower's."""
    from mmserve.worker.kernel_plan import float32_outruns_bfloat16

    bf16 = built_model(load_model_config(model_dir, dtype="bfloat16"), "cpu")
    fp32 = built_model(load_model_config(model_dir, dtype="float32"), "cpu")
    tower_dtypes = {p.dtype for p in bf16.visual.parameters()}  # norms: linears hold their weights
    assert tower_dtypes == {torch.float32 if float32_outruns_bfloat16() else torch.bfloat16}
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    inputs = processor(images=[synthetic_image(640, 480, seed=3)], return_tensors="pt")
    grid = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    [got] = bf16.encode_images([inputs["pixel_values"]], grid)
    [want] = fp32.encode_images([inputs["pixel_values"]], grid)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < 2**-5
