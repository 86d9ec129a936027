"""Export a trained model to ONNX, then check the ONNX file against PyTorch with onnxruntime.

    python -m common.tools.export runs/cifar_cnn-20250101-120000 --onnx cifar.onnx
    python -m common.tools.export runs/mnist/best --onnx mnist_raw.onnx --no-preprocess

What the ONNX model takes and returns:

- default: input ``images``, float32 ``(N, C, H, W)`` with pixel values in [0, 1] (uint8 pixels / 255),
  RGB or grayscale as model.json's input_shape says, at exactly that H x W. The normalization
  ``(x - mean) / std`` with the run's mean/std is folded into the graph, and when the run
  evaluated with ``--tta`` the graph also averages the logits over the same views
  (``common.train.metrics.tta_logits``: the mirror image, and at level 2 the 1-pixel shifts; ``--no-tta``
  leaves that out). Resize and convert images yourself as ``common.tools.predict`` does.
- ``--no-preprocess``: the bare network; input ``images`` must already be normalized.
- output ``logits``: float32 ``(N, num_classes)``; apply softmax for probabilities. The batch
  dimension N is dynamic. Class names, mean/std and this description are stored in the ONNX
  metadata (``metadata_props``).

Exporters (``--exporter``):

- ``torchscript`` (default): torch's TorchScript-based exporter, ``torch.onnx.export(..., dynamo=False)``.
  It needs the ``onnx`` package, which ``pip install -r requirements.txt`` installs, and nothing
  else. torch marks it deprecated but still ships it in the versions requirements.txt allows
  (checked with torch 2.14.1, the version README installs).
- ``dynamo``: the torch.export-based exporter, ``dynamo=True`` (torch.onnx.export's own default).
  It needs ``onnx`` and ``onnxscript``; requirements.txt does not install onnxscript, so run
  ``pip install onnxscript`` before choosing it.

The check: a random batch, and a batch of one, are run through the ONNX file with onnxruntime (installed by
requirements.txt) and through the PyTorch model; the max abs difference of the logits must be below ``--atol`` (default
1e-4; relative to the largest logit when that is above 1).

Exit codes: 0 ok (the check passed), 1 the onnxruntime check failed, 2 bad input or a missing package
(one paragraph on stderr that names the fix, no traceback, no file written).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from common.errors import EXIT_CHECK_FAILED, RecipeError, printable, run_command
from common.tools.predict import load_predictor, model_arguments
from common.train.metrics import tta_logits


class ExportWrapper(nn.Module):
    """``model`` with the eval preprocessing in front of it: float images in [0, 1] -> logits."""

    def __init__(self, model: nn.Module, mean, std, preprocess: bool = True, tta: int = 0):
        super().__init__()
        self.model, self.preprocess, self.tta = model, preprocess, tta
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = (images - self.mean) / self.std if self.preprocess else images

        return tta_logits(self.model, x, self.tta)


def input_description(card: dict, preprocess: bool, tta: bool) -> str:
    c, h, w = card["input_shape"]
    kind = {1: "grayscale", 3: "RGB"}.get(c, f"{c}-channel")
    if preprocess:
        what = (
            f"float32 (N, {c}, {h}, {w}) {kind} images with values in [0, 1]; normalization with mean "
            f"{[round(m, 4) for m in card['mean']]} std {[round(s, 4) for s in card['std']]} is inside the graph"
        )
    else:
        what = (
            f"float32 (N, {c}, {h}, {w}) {kind} images already normalized: (pixel/255 - mean) / std with "
            f"mean {card['mean']} std {card['std']}"
        )
    if card.get("preprocess"):  # a photo run (common.data.photos): how a photo of any size becomes that input
        p = card["preprocess"]
        what = (
            f"photos of any size: resize the shorter side to {p['resize_shorter']} (bilinear, antialiased) and "
            f"crop the centre {p['center_crop']}x{p['center_crop']}, then {what}"
        )
    views = {
        1: "; logits averaged with the mirror image (TTA)",
        2: "; logits averaged over 6 views: the image, its 1-pixel shifts and their mirrors (TTA)",
    }
    return what + views.get(int(tta), "") + f". Output: logits (N, {len(card['class_names'])})."


def takes_dynamo() -> bool:
    """Whether torch.onnx.export chooses its exporter (torch >= 2.5); before, it is TorchScript's, with no argument."""
    return "dynamo" in inspect.signature(torch.onnx.export).parameters


def check_packages(exporter: str) -> bool:
    """Fail before any work when a package the export or the check needs is missing (one paragraph naming what needs
    it and how to install it). True for the torch.export-based (dynamo) exporter, False for the TorchScript one."""
    dynamo = exporter == "dynamo"
    if dynamo and not takes_dynamo():
        raise RecipeError(
            f"--exporter dynamo needs torch 2.5 or newer (this is torch {torch.__version__}). "
            "Leave out --exporter to use the TorchScript exporter, or upgrade torch."
        )
    reinstall = "Run `pip install -r requirements.txt` (or `pip install onnx onnxruntime`)."
    needs = [("onnx", "ONNX export (either exporter)", reinstall)]
    needs.append(("onnxruntime", "The check of the ONNX file against PyTorch", reinstall))
    if dynamo:
        fix = "Run `pip install onnxscript`, or leave out --exporter to use the default TorchScript exporter, which "
        needs.append(("onnxscript", "--exporter dynamo (the torch.export-based exporter)", fix + "needs only onnx."))
    for module, needed_for, fix in needs:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise RecipeError(
                f"{needed_for} needs the {module} package, which is not importable ({err}). {fix} Nothing was written."
            ) from None
    return dynamo


def export_onnx(wrapper: nn.Module, example: torch.Tensor, out: Path, dynamo: bool, opset: int | None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    kwargs = dict(input_names=["images"], output_names=["logits"], opset_version=opset)
    if dynamo:
        kwargs.update(external_data=False, dynamic_shapes={"images": {0: torch.export.Dim("batch", min=1)}})
    else:
        kwargs["dynamic_axes"] = {"images": {0: "batch"}, "logits": {0: "batch"}}
    if takes_dynamo():
        kwargs["dynamo"] = dynamo  # torch >= 2.9 defaults to True, which needs onnxscript
    with warnings.catch_warnings():
        if not dynamo:  # torch >= 2.9 warns on every call that this exporter is deprecated
            warnings.simplefilter("ignore")
        torch.onnx.export(wrapper, (example,), str(out), **kwargs)


def add_metadata(out: Path, card: dict, description: str) -> None:
    """Store class names, preprocessing and the input description in the ONNX file's metadata_props."""
    import onnx

    model = onnx.load(str(out))
    onnx.helper.set_model_props(
        model,
        {
            "class_names": json.dumps([str(n) for n in card["class_names"]]),
            "input": description,
            **{key: json.dumps(card.get(key)) for key in ("mean", "std", "input_shape", "preprocess")},
            "recipe": str(card.get("recipe", "")),
            "model": str(card.get("model", "")),
        },
    )
    onnx.save(model, str(out))


def check_onnxruntime(out: Path, wrapper: nn.Module, example: torch.Tensor) -> float:
    """Max logit difference between onnxruntime and PyTorch, relative to the logits' size when that is above 1
    (a deep network's logits of 30 differ by 1e-4 from fp32 sums in another order alone); inf when the output
    shapes differ."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    worst = 0.0
    for batch in (example, example[:1]):  # the full batch and a batch of one: the batch axis is dynamic
        got = session.run(["logits"], {"images": batch.numpy()})[0]
        with torch.no_grad():
            want = wrapper(batch).float().numpy()
        if got.shape != want.shape:
            return float("inf")
        worst = max(worst, float(abs(got - want).max()) / max(1.0, float(abs(want).max())))
    return worst


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m common.tools.export",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_arguments(parser)
    parser.add_argument("--onnx", required=True, help="path of the .onnx file to write")
    parser.add_argument(
        "--no-preprocess", action="store_true", help="export the bare network, which takes normalized images"
    )
    parser.add_argument(
        "--no-tta",
        action="store_true",
        help="leave the test-time augmentation out of the graph even if the run evaluated with --tta",
    )
    parser.add_argument(
        "--exporter",
        choices=("torchscript", "dynamo"),
        default="torchscript",
        help="torchscript (default): needs onnx, installed by requirements.txt; dynamo: the "
        "torch.export-based exporter, also needs `pip install onnxscript`",
    )
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset version (default: the exporter's)")
    parser.add_argument("--check-batch", type=int, default=4, help="random images in the onnxruntime check")
    parser.add_argument(
        "--atol",
        type=float,
        default=1e-4,
        help="max logit difference allowed, relative to the largest logit when that is above 1 (default 1e-4)",
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    if args.check_batch < 1:
        raise RecipeError(f"--check-batch must be at least 1 (got {args.check_batch}).")
    out = Path(args.onnx).expanduser()
    if out.is_dir():
        raise RecipeError(f"--onnx {out} is a folder. Pass a file path such as {out / 'model.onnx'}.")
    dynamo = check_packages(args.exporter)
    predictor = load_predictor(args.model, "cpu", tta=0 if args.no_tta else None, recipe_file=args.recipe)
    card = predictor.card
    preprocess = not args.no_preprocess
    wrapper = ExportWrapper(predictor.model, card["mean"], card["std"], preprocess, predictor.tta).eval()
    gen = torch.Generator().manual_seed(0)
    example = torch.rand((args.check_batch, *predictor.input_shape), generator=gen)
    if not preprocess:  # what a normalized batch looks like
        example = (example - wrapper.mean) / wrapper.std
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.onnx")  # a previous good file stays until the check passed
    exporter = "dynamo" if dynamo else "TorchScript"
    try:
        try:
            export_onnx(wrapper, example, tmp, dynamo, args.opset)
        except Exception as err:  # the exporters raise many types
            other = (
                "leave out --exporter to use the TorchScript exporter"
                if dynamo
                else ("try the torch.export-based exporter: `pip install onnxscript`, then add --exporter dynamo")
            )
            first = (str(err).strip().splitlines() or [""])[0]
            raise RecipeError(
                f"torch.onnx.export ({exporter} exporter, torch {torch.__version__}) failed on this model: "
                f"{type(err).__name__}: {first}. To get a file, {other}, or pass another --opset (e.g. --opset 17)."
            ) from None
        description = input_description(card, preprocess, predictor.tta)
        add_metadata(tmp, card, description)
        diff = check_onnxruntime(tmp, wrapper, example)
        if not diff < args.atol:
            print(
                f"onnxruntime check FAILED: max logit difference to torch is {diff:.3g} (relative to the largest "
                f"logit above 1; allowed {args.atol:g}) on {args.check_batch} random images; {out} was not written"
                f"{' (the previous file there is kept)' if out.exists() else ''}"
            )
            return EXIT_CHECK_FAILED
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)  # a half-written file is worse than none
    import onnxruntime

    print(
        f"wrote {out} from {printable(predictor.model_dir)} ({printable(card.get('model'))}, {exporter} exporter, "
        f"torch {torch.__version__})\ninput: {printable(description)}\n"  # it quotes model.json's mean and std
        f"onnxruntime check passed: max logit difference to torch {diff:.3g} < {args.atol:g} "
        f"({args.check_batch} random images, onnxruntime {onnxruntime.__version__})"
    )
    return 0


def main(argv=None) -> int:
    return run_command(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
