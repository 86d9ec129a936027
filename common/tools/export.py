"""Export a trained model to ONNX, then check the ONNX file against PyTorch with onnxruntime.

    python -m common.tools.export runs/cifar_cnn-20250101-120000 --onnx cifar.onnx
    python -m common.tools.export runs/mnist/best --onnx mnist_raw.onnx --no-preprocess

What the ONNX model takes and returns:

- default: input ``images``, float32 ``(N, C, H, W)`` with pixel values in [0, 1] (uint8 pixels / 255),
  RGB or grayscale as model.json's input_shape says, at exactly that H x W. The normalization
  ``(x - mean) / std`` with the run's mean/std is folded into the graph, and when the run
  evaluated with ``--tta`` the graph also averages the logits of the image and its mirror image
  (``--no-tta`` leaves that out). Resize and convert images yourself as ``common.tools.predict`` does.
- ``--no-preprocess``: the bare network; input ``images`` must already be normalized.
- output ``logits``: float32 ``(N, num_classes)``; apply softmax for probabilities. The batch
  dimension N is dynamic. Class names, mean/std and this description are stored in the ONNX
  metadata (``metadata_props``) when the ``onnx`` package is installed.

The exporter: torch's torch.export-based one (``dynamo=True``) needs the ``onnxscript`` package;
``--exporter auto`` (default) uses it when onnxscript is importable and otherwise the TorchScript
exporter (``dynamo=False``), which needs nothing extra. After export, if onnxruntime is importable,
a random batch is run through both and the max abs difference of the logits must be below
``--atol`` (default 1e-4); otherwise the check is skipped and the reason printed.

Exit codes: 0 ok (check passed or skipped), 1 the onnxruntime check failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from common.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, RecipeError
from common.tools.predict import load_predictor



class ExportWrapper(nn.Module):
    """``model`` with the eval preprocessing in front of it: float images in [0, 1] -> logits."""

    def __init__(self, model: nn.Module, mean, std, preprocess: bool = True, tta: bool = False):
        super().__init__()
        self.model, self.preprocess, self.tta = model, preprocess, tta
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = (images - self.mean) / self.std if self.preprocess else images
        logits = self.model(x)
        if self.tta:
            logits = 0.5 * (logits + self.model(torch.flip(x, dims=[3])))
        return logits


def input_description(card: dict, preprocess: bool, tta: bool) -> str:
    c, h, w = card["input_shape"]
    kind = {1: "grayscale", 3: "RGB"}.get(c, f"{c}-channel")
    if preprocess:
        what = (f"float32 (N, {c}, {h}, {w}) {kind} images with values in [0, 1]; normalization with mean "
                f"{[round(m, 4) for m in card['mean']]} std {[round(s, 4) for s in card['std']]} is inside the graph")
    else:
        what = (f"float32 (N, {c}, {h}, {w}) {kind} images already normalized: (pixel/255 - mean) / std with "
                f"mean {card['mean']} std {card['std']}")
    return what + ("; logits averaged with the mirror image (TTA)" if tta else "") + \
        f". Output: logits (N, {len(card['class_names'])})."


def pick_exporter(choice: str) -> bool:
    """True for the torch.export-based (dynamo) exporter, False for the TorchScript one."""
    has_onnxscript = importlib.util.find_spec("onnxscript") is not None
    if choice == "dynamo" and not has_onnxscript:
        raise RecipeError("--exporter dynamo needs the onnxscript package, which is not installed. "
                           "Run `pip install onnxscript`, or use --exporter legacy (or auto).")
    return choice == "dynamo" or (choice == "auto" and has_onnxscript)


def export_onnx(wrapper: nn.Module, example: torch.Tensor, out: Path, dynamo: bool, opset: int | None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    common = dict(input_names=["images"], output_names=["logits"], opset_version=opset)
    if dynamo:
        batch = torch.export.Dim("batch", min=1)
        torch.onnx.export(wrapper, (example,), str(out), dynamo=True, external_data=False,
                          dynamic_shapes={"images": {0: batch}}, **common)
    else:
        with warnings.catch_warnings():  # the TorchScript exporter warns that it is deprecated
            warnings.simplefilter("ignore")
            torch.onnx.export(wrapper, (example,), str(out), dynamo=False,
                              dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}}, **common)


def add_metadata(out: Path, card: dict, description: str) -> bool:
    """Store class names, preprocessing and the input description in the ONNX file (needs onnx)."""
    try:
        import onnx
    except ImportError:
        return False
    model = onnx.load(str(out))
    meta = {"class_names": json.dumps([str(n) for n in card["class_names"]]), "input": description,
            "mean": json.dumps(card["mean"]), "std": json.dumps(card["std"]),
            "input_shape": json.dumps(card["input_shape"]), "recipe": str(card.get("recipe", "")),
            "model": str(card.get("model", ""))}
    del model.metadata_props[:]
    for key, value in meta.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(out))
    return True


def check_onnxruntime(out: Path, wrapper: nn.Module, example: torch.Tensor):
    """Returns (max_abs_diff, None), or (None, reason the check was skipped)."""
    try:
        import onnxruntime as ort
    except ImportError as err:
        return None, f"onnxruntime is not importable ({err}); `pip install onnxruntime` to enable the check"
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    worst = 0.0
    for batch in (example, example[:1]):  # the full batch and a batch of one: the batch axis is dynamic
        got = session.run(["logits"], {"images": batch.numpy()})[0]
        with torch.no_grad():
            want = wrapper(batch).float().numpy()
        if got.shape != want.shape:
            return float("inf"), None
        worst = max(worst, float(abs(got - want).max()))
    return worst, None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m common.tools.export", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="run directory, or its best/ or final/ folder")
    parser.add_argument("--onnx", required=True, help="path of the .onnx file to write")
    parser.add_argument("--no-preprocess", action="store_true",
                        help="export the bare network, which takes normalized images")
    parser.add_argument("--no-tta", action="store_true", help="leave the mirror-image averaging out of the graph "
                        "even if the run evaluated with --tta")
    parser.add_argument("--exporter", choices=("auto", "dynamo", "legacy"), default="auto",
                        help="auto: dynamo when onnxscript is installed, else legacy (TorchScript)")
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset version (default: the exporter's)")
    parser.add_argument("--check-batch", type=int, default=4, help="random images in the onnxruntime check")
    parser.add_argument("--atol", type=float, default=1e-4, help="max abs logit difference allowed (default 1e-4)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    if args.check_batch < 1:
        raise RecipeError(f"--check-batch must be at least 1 (got {args.check_batch}).")
    out = Path(args.onnx).expanduser()
    if out.is_dir():
        raise RecipeError(f"--onnx {out} is a folder. Pass a file path such as {out / 'model.onnx'}.")
    predictor = load_predictor(args.model, "cpu", tta=False if args.no_tta else None)
    card = predictor.card
    preprocess = not args.no_preprocess
    wrapper = ExportWrapper(predictor.model, card["mean"], card["std"], preprocess, predictor.tta).eval()
    dynamo = pick_exporter(args.exporter)
    gen = torch.Generator().manual_seed(0)
    example = torch.rand((args.check_batch, *predictor.input_shape), generator=gen)
    if not preprocess:  # what a normalized batch looks like
        example = (example - wrapper.mean) / wrapper.std
    try:
        export_onnx(wrapper, example, out, dynamo, args.opset)
    except Exception as err:  # the exporters raise many types
        raise RecipeError(f"torch.onnx.export ({'dynamo' if dynamo else 'TorchScript'} exporter) failed: "
                           f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}. "
                           f"Try --exporter {'legacy' if dynamo else 'dynamo (pip install onnxscript)'} or "
                           "another --opset.") from None
    description = input_description(card, preprocess, predictor.tta)
    stored = add_metadata(out, card, description)
    print(f"wrote {out} from {predictor.model_dir} ({card.get('model')}, "
          f"{'dynamo' if dynamo else 'TorchScript'} exporter, torch {torch.__version__})")
    print(f"input: {description}")
    if not stored:
        print("note: the onnx package is not installed, so class names were not stored in the file's metadata")
    diff, skipped = check_onnxruntime(out, wrapper, example)
    if skipped:
        print(f"onnxruntime check skipped: {skipped}")
        return 0
    if not diff < args.atol:
        print(f"onnxruntime check FAILED: max abs logit difference to torch is {diff:.3g} "
              f"(allowed {args.atol:g}) on {args.check_batch} random images")
        return EXIT_CHECK_FAILED
    import onnxruntime

    print(f"onnxruntime check passed: max abs logit difference to torch {diff:.3g} < {args.atol:g} "
          f"({args.check_batch} random images, onnxruntime {onnxruntime.__version__})")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
