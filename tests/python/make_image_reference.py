"""Reference Qwen2-VL / Qwen2.5-VL image preprocessing from transformers, for
runtime/tests/vision_preprocess_parity.rs.

Usage: make_image_reference.py OUT_DIR

Draws deterministic images of odd sizes and modes, saves them as PNG (and one JPEG), and runs
transformers' `Qwen2VLImageProcessorPil` (the PIL backend: no torchvision) on each file as
opened by PIL, under two settings: the processor's defaults and custom min/max pixels. Writes

- images/<case>.png|jpg: the inputs,
- <setting>/preprocessor_config.json: the processor saved with `save_pretrained`,
- reference.safetensors: `pixel_values/<setting>/<case>` (f32) and `image_grid_thw/<setting>/<case>`
  (i64) for each case the processor accepts,
- manifest.json: the cases and settings, and the error message for each case it refuses.
"""

import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from safetensors.numpy import save_file
from transformers import Qwen2VLImageProcessorPil

SETTINGS = {
    "default": {},
    # Small enough that most images are scaled down hard (wide filter support) and the large
    # one hits max_pixels; min_pixels above the default so the tiny ones are scaled up more.
    "custom": {"min_pixels": 28 * 28 * 8, "max_pixels": 28 * 28 * 64},
}


def textured(rng, height, width, channels):
    """Gradients, hard 0/255 edges (bicubic overshoot must clip) and noise."""
    yy, xx = np.mgrid[0:height, 0:width]
    planes = []
    for c in range(channels):
        gradient = (xx * (3 + c) + yy * (5 - c)) % 256
        edges = np.where(((xx // (4 + c)) + (yy // (3 + c))) % 2 == 0, 0, 255)
        noise = rng.integers(0, 256, size=(height, width))
        mix = np.where(rng.random((height, width)) < 0.5, gradient, edges)
        planes.append(np.where(rng.random((height, width)) < 0.2, noise, mix))
    return np.stack(planes, axis=-1).astype(np.uint8)


def smooth(height, width):
    """A photo-like image for the JPEG case: smooth colour fields with a few edges."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    r = 128 + 100 * np.sin(xx / 17.0) * np.cos(yy / 23.0)
    g = 128 + 90 * np.cos((xx + yy) / 31.0)
    b = np.where((xx - width / 2) ** 2 + (yy - height / 2) ** 2 < (height / 3) ** 2, 220.0, 40.0)
    return np.clip(np.stack([r, g, b], axis=-1), 0, 255).astype(np.uint8)


def images(rng):
    """(case name, PIL image, file extension) for every case."""
    cases = [
        ("rgb_1x1", Image.fromarray(textured(rng, 1, 1, 3)), "png"),
        ("rgb_3x5", Image.fromarray(textured(rng, 3, 5, 3)), "png"),
        ("rgb_37x53", Image.fromarray(textured(rng, 37, 53, 3)), "png"),
        ("rgb_61x200", Image.fromarray(textured(rng, 61, 200, 3)), "png"),
        ("rgb_513x1023", Image.fromarray(textured(rng, 513, 1023, 3)), "png"),
        # Already a multiple of 28 within the pixel bounds: no resampling at all.
        ("rgb_56x112_exact", Image.fromarray(textured(rng, 56, 112, 3)), "png"),
        ("grey_211x300", Image.fromarray(textured(rng, 211, 300, 1)[..., 0]), "png"),
        ("rgba_97x150", Image.fromarray(textured(rng, 97, 150, 4)), "png"),
        ("grey_alpha_64x45", Image.fromarray(textured(rng, 64, 45, 2)), "png"),
        ("wide_20x3900", Image.fromarray(textured(rng, 20, 3900, 3)), "png"),
        ("large_900x1200", Image.fromarray(textured(rng, 900, 1200, 3)), "png"),
        # Aspect ratio 250 > 200: the processor refuses it.
        ("too_wide_1x250", Image.fromarray(textured(rng, 1, 250, 3)), "png"),
    ]
    palette = Image.fromarray(textured(rng, 80, 120, 3)).quantize(
        colors=37, method=Image.Quantize.MEDIANCUT
    )
    cases.append(("palette_80x120", palette, "png"))
    transparent = palette.copy()
    transparent.info["transparency"] = 5
    cases.append(("palette_transparent_80x120", transparent, "png"))
    grey16 = (textured(rng, 40, 70, 2).astype(np.uint16) * np.uint16(4)).astype(np.uint16)[..., 0]
    cases.append(("grey16_40x70", Image.fromarray(grey16), "png"))
    cases.append(("jpeg_250x333", Image.fromarray(smooth(250, 333)), "jpg"))
    return cases


def main():
    out = Path(sys.argv[1])
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20250101)
    manifest = {"settings": {}, "cases": []}
    tensors = {}
    processors = {}
    for setting, kwargs in SETTINGS.items():
        processor = Qwen2VLImageProcessorPil(**kwargs)
        processor.save_pretrained(out / setting)
        processors[setting] = processor
        manifest["settings"][setting] = kwargs
    for name, image, ext in images(rng):
        path = out / "images" / f"{name}.{ext}"
        # PNG keeps `info["transparency"]` (a tRNS chunk); the JPEG is 4:2:0, PIL's default.
        image.save(path, **({"quality": 90} if ext == "jpg" else {}))
        case = {"name": name, "file": f"images/{name}.{ext}", "errors": {}}
        for setting, processor in processors.items():
            # Opened from the file, as a server receiving these bytes would.
            with Image.open(path) as opened:
                try:
                    result = processor(images=opened, return_tensors="np")
                except ValueError as e:
                    case["errors"][setting] = str(e)
                    continue
            pixel_values = np.ascontiguousarray(result["pixel_values"], dtype=np.float32)
            grid = np.ascontiguousarray(result["image_grid_thw"], dtype=np.int64)
            tensors[f"pixel_values/{setting}/{name}"] = pixel_values
            tensors[f"image_grid_thw/{setting}/{name}"] = grid
        manifest["cases"].append(case)
    save_file(tensors, str(out / "reference.safetensors"))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
