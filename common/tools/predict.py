"""Classify image files with a trained model: top-k class names and probabilities.

    python -m common.tools.predict runs/cifar_cnn-20250101-120000 photo.png more_photos/ --top-k 3
    python -m common.tools.predict runs/mnist/best digits/ --format json --output predictions.json

The first argument is a run directory (its best/ is used, else final/) or a best/ or final/ folder itself:
model.safetensors + model.json as ``common.train.checkpoint.save_model_dir`` writes them. Folders are walked as
training walks an image folder. Preprocessing is the run's evaluation one (``load_image``), normalized with the
mean/std in model.json; when the run evaluated with ``--tta`` the logits are averaged over the same views
(``common.train.metrics.tta_logits``).

Exit codes: 0 ok, 2 bad input (missing path, unreadable image, no model files), one paragraph on stderr and no
traceback. ``load_predictor`` and ``predict_files`` are importable for tests and other tools.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path, PurePath

import torch

from common.data.augment import normalize
from common.data.photos import eval_view
from common.data.pixels import at_size, read_rgb, unreadable_reason
from common.data.walk import images_below
from common.errors import RecipeError, printable, run_command
from common.tools.recipe_files import RECIPES_DIR, import_recipe
from common.train.checkpoint import find_model_dir, load_model_dir
from common.train.metrics import tta_logits

# --- model ---------------------------------------------------------------------------------------


def repository_recipe(card: dict, ours: Path) -> bool:
    """Whether the run was trained by ``ours``, this repository's ``recipes/<name>.py``: its bytes are the ones
    model.json records (``recipe_sha256``: in this clone, another clone or on another machine); for a card without
    them, the file model.json records is ``ours``. A copy named like a recipe, edited to build another model, is not
    taken for it; nor is ``ours`` edited since, or another version of the recipe, whose model it may build otherwise."""
    recorded = card.get("recipe_file")
    if card.get("recipe_sha256"):  # the bytes decide, in this clone too: the file may have been edited since
        return not changed_since(card, ours)
    if not recorded or Path(recorded).resolve() == ours.resolve():  # no file: written before model.json named it
        return True
    recorded = PurePath(str(recorded))  # written before model.json recorded the file's bytes
    return recorded.name == ours.name and recorded.parent.name == "recipes"


def changed_since(card: dict, path: Path) -> str:
    """How ``path`` differs from the recipe file the run trained with, by model.json's ``recipe_sha256`` ('' when it
    is that file, or the card records no digest)."""
    import hashlib

    digest = card.get("recipe_sha256")
    if not digest or not path.is_file():
        return ""
    now = hashlib.sha256(path.read_bytes()).hexdigest()
    if now == digest:
        return ""
    return (
        f"is not the file this run trained with: its sha256 is {now[:12]}..., model.json records {digest[:12]}... "
        "(the file changed since)"
    )


def load_recipe(card: dict, recipe_file=None):
    """Import the recipe that trained the model, as a module. A run folder is data, not code: without
    ``recipe_file`` (--recipe, the user's explicit word) only the repository's own ``recipes/<name>.py`` is
    imported, where the name model.json gives is a bare recipe name and the file it records is a ``recipes/``
    file (a copy named like a recipe is not the recipe). Anything else model.json points at is refused with the
    path and the flag that trusts it."""
    name, recorded = str(card.get("recipe", "")), card.get("recipe_file") or "no file recorded"
    if recipe_file:
        path = Path(recipe_file).expanduser()
        if not path.is_file():
            raise RecipeError(f"--recipe {recipe_file} is not a file. Pass the recipe file the run was trained with.")
        if changed := changed_since(card, path):
            print(
                f"NOTE: --recipe {printable(path)} {changed}; the model is built from it as it is now.", file=sys.stderr
            )
    elif (
        name.isascii()
        and name.isidentifier()  # a bare recipe name, not a path
        and (RECIPES_DIR / f"{name}.py").is_file()
        and repository_recipe(card, RECIPES_DIR / f"{name}.py")
    ):
        path = RECIPES_DIR / f"{name}.py"
    elif Path(recorded).resolve() == (ours := RECIPES_DIR / f"{name}.py") and (changed := changed_since(card, ours)):
        raise RecipeError(
            f"{ours} {changed}: its build_model may build another model than the one whose weights "
            f"these are, and importing it runs it. Pass --recipe {ours} to build from the file as it is now, or "
            "--recipe with the version the run trained with (git show <commit>:recipes/"
            f"{name}.py > {name}_then.py)."
        )
    else:
        raise RecipeError(
            f"model.json names the recipe {name!r} ({recorded}), which is not one of this repository's "
            f"recipes in {RECIPES_DIR} as they are now. Its model is defined in that file, and importing it runs it, "
            "so it is not imported on the word of a run folder. If you trust the file (e.g. your own copy "
            "of a recipe, which trained this run), pass --recipe path/to/that_recipe.py."
        )

    try:
        module = import_recipe(path)  # recipes run nothing at import (their main is behind __name__)
    except Exception as err:
        raise RecipeError(
            f"Could not import the recipe {path}: {type(err).__name__}: {err}. Fix it, or pass "
            "--recipe with the recipe file the run was trained with."
        ) from None
    for name in ("build_model", "Config"):
        if not hasattr(module, name):
            raise RecipeError(
                f"The recipe {path} has no {name}; a recipe defines Config and build_model(cfg, "
                "in_shape, num_classes) so its runs can be predicted, exported and evaluated."
            )
    return module


def build_model_from_card(card: dict, recipe_file=None) -> torch.nn.Module:
    """An untrained model as the run built it: the recipe's own ``build_model`` with the run's config,
    input shape and class count (so a model class defined in a copied recipe works too)."""
    import dataclasses

    if missing := [k for k in ("input_shape", "class_names", "config") if k not in card]:
        raise RecipeError(
            f"model.json lacks {', '.join(missing)}: it was not written by a recipe of this "
            "repository (or is damaged). Point at a best/ or final/ folder of a finished run."
        )
    recipe = load_recipe(card, recipe_file)
    known = {f.name for f in dataclasses.fields(recipe.Config)}
    try:
        cfg = recipe.Config(**{k: v for k, v in card["config"].items() if k in known})
        return recipe.build_model(cfg, tuple(card["input_shape"]), len(card["class_names"]))
    except RecipeError:  # already one paragraph naming the problem (a model folder that asks to run its code)
        raise
    except Exception as err:
        raise RecipeError(
            f"Could not rebuild the model of {card.get('recipe')} from model.json (input_shape "
            f"{card['input_shape']}): {type(err).__name__}: {err}."
        ) from None


@dataclass
class Predictor:
    """A model in eval mode plus what it needs to turn uint8 images into probabilities."""

    model: torch.nn.Module
    card: dict
    model_dir: Path
    device: torch.device
    tta: int  # test-time augmentation level (common.train.metrics.tta_logits)

    @property
    def class_names(self) -> list[str]:
        return [str(n) for n in self.card["class_names"]]

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.card["input_shape"])

    @torch.no_grad()
    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``(N, C, H, W)`` at the model's input shape -> float32 logits ``(N, classes)``."""
        x = normalize(images.to(self.device), self.card["mean"], self.card["std"])
        return tta_logits(self.model, x, self.tta)  # the same views as the run's evaluation

    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.logits(images), dim=1)


def load_predictor(path, device: str | torch.device = "cpu", tta: int | None = None, recipe_file=None) -> Predictor:
    """Load model.safetensors + model.json from a run dir / best/ / final/ folder. ``tta=None``
    follows the run's config (``card["config"]["tta"]``)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise RecipeError(
            f"The model path {path} does not exist. Pass a run directory (runs/<recipe>-<time>) "
            "or its best/ or final/ folder."
        )
    try:
        model_dir = find_model_dir(path)
        state, card = load_model_dir(model_dir)
    except FileNotFoundError as err:
        raise RecipeError(str(err)) from None
    except Exception as err:  # safetensors / json raise several types for a damaged file
        raise RecipeError(
            f"Could not read the model files in {path}: {type(err).__name__}: {err}. The files "
            "may be damaged or partly written; use the other folder (best/ or final/) or "
            "re-run the training."
        ) from None
    for key in ("mean", "std"):
        if key not in card:
            raise RecipeError(
                f"{model_dir / 'model.json'} lacks {key!r}, which preprocessing needs. Point at a "
                "best/ or final/ folder written by a recipe of this repository."
            )
    model = build_model_from_card(card, recipe_file)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise RecipeError(
            f"The weights in {model_dir} do not fit the model model.json describes "
            f"({card.get('model')} of {card.get('recipe')}): {str(err).splitlines()[0]} The folder "
            "mixes files of different runs; re-copy it from one run."
        ) from None
    device = torch.device(device)
    model.to(device).eval()
    if tta is None:
        tta = int((card.get("config") or {}).get("tta", 0))  # a level; older runs stored True for the mirror
    return Predictor(model, card, model_dir, device, tta)


# --- images --------------------------------------------------------------------------------------


def collect_images(inputs) -> list[Path]:
    """Files as given, folders expanded to the image files they hold (walked as training walks an image folder,
    ``common.data.walk``: recursively, sorted, links followed, hidden entries skipped), each file once."""
    found: list[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_dir():
            if not (files := [Path(f) for f in images_below(p)]):
                raise RecipeError(
                    f"The folder {p} holds no image files (files Pillow opens: .png, .jpg, .jpeg, "
                    ".bmp, .gif, .webp, .tif, ...). Pass image files, or folders that contain some."
                )
            found.extend(files)
        elif p.is_file():
            found.append(p)
        else:
            raise RecipeError(f"The input {item} does not exist. Pass existing image files or folders.")
    return list(dict.fromkeys(found))


def load_image(path, input_shape, preprocess: dict | None = None) -> tuple[torch.Tensor, bool]:
    """An image file -> (uint8 ``(C, H, W)`` tensor at ``input_shape``, whether it was resized to a size it did not
    have), read as the run read it. A photo run (``preprocess`` in model.json, ``common.data.photos``): its very
    reading (JPEG draft decoding too), the shorter side resized and the centre cropped. Else as the decoded-cache
    recipes decode (``common.data.pixels``: EXIF, 16-bit and transparency; 'L' or 'RGB'), then a bilinear resize to
    the input size as ``--image-size`` does."""
    from PIL import Image, UnidentifiedImageError
    from torchvision.transforms.v2.functional import pil_to_tensor

    c, h, w = input_shape
    try:
        if preprocess:
            view = eval_view(read_rgb(str(path), int(preprocess["resize_shorter"])), int(preprocess["center_crop"]))
            return view.contiguous(), False
        with Image.open(path) as opened:
            opened.load()
            img, resized = at_size(opened, "L" if c == 1 else "RGB", (w, h))
            return pil_to_tensor(img).contiguous(), resized
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
        raise RecipeError(
            f"Could not read {printable(path)} as an image ({printable(unreadable_reason(err))}). Pass image files "
            "(PNG, JPEG, ...) or remove that file from the folder."
        ) from None


def predict_files(predictor: Predictor, paths, top_k: int = 3, batch_size: int = 64, on_resize=None) -> list[dict]:
    """Top-k predictions per file: ``[{"file", "predictions": [{"label", "index", "probability"}]}]``.
    Images are read ``batch_size`` at a time. ``on_resize(path)`` is called for each resized image."""
    names = predictor.class_names
    k = max(1, min(int(top_k), len(names)))
    paths = [Path(p) for p in paths]
    results = []
    for start in range(0, len(paths), max(1, batch_size)):
        chunk = paths[start : start + max(1, batch_size)]
        tensors = []
        for p in chunk:
            image, resized = load_image(p, predictor.input_shape, predictor.card.get("preprocess"))
            if resized and on_resize is not None:
                on_resize(p)
            tensors.append(image)
        probs = predictor.probabilities(torch.stack(tensors)).cpu()
        top_p, top_i = probs.topk(k, dim=1)
        for p, ps, idx in zip(chunk, top_p.tolist(), top_i.tolist()):
            results.append(
                {
                    "file": str(p),
                    "predictions": [{"label": names[i], "index": i, "probability": prob} for i, prob in zip(idx, ps)],
                }
            )
    return results


# --- output --------------------------------------------------------------------------------------
# Class names come from model.json and file names from the folders given: both are printed through
# printable(), so an escape sequence in a received run folder shows as text instead of acting on the
# terminal. JSON escapes control characters itself.


def format_table(results: list[dict]) -> str:
    if not results:
        return ""
    rows = [["file", *(f"top-{i + 1}" for i in range(len(results[0]["predictions"])))]]
    for r in results:
        rows.append(
            [printable(r["file"]), *(f"{printable(p['label'])} {p['probability']:.1%}" for p in r["predictions"])]
        )
    widths = [max(map(len, column)) for column in zip(*rows)]
    return "".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() + "\n" for row in rows)


def format_csv(results: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    k = len(results[0]["predictions"]) if results else 0
    writer.writerow(["file", *(f"top{i + 1}_{c}" for i in range(k) for c in ("label", "probability"))])
    for r in results:
        labels = ((printable(p["label"]), f"{p['probability']:.6f}") for p in r["predictions"])
        writer.writerow([printable(r["file"]), *(v for pair in labels for v in pair)])
    return buf.getvalue()


def format_json(results: list[dict], predictor: Predictor) -> str:
    card = predictor.card
    doc = {"model_dir": str(predictor.model_dir), "model": card.get("model"), "recipe": card.get("recipe")}
    return json.dumps({**doc, "tta": predictor.tta, "results": results}, indent=2) + "\n"


# --- command line --------------------------------------------------------------------------------


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model folder and --recipe, as predict and export take them."""
    parser.add_argument("model", help="run directory, or its best/ or final/ folder")
    parser.add_argument(
        "--recipe",
        help="the recipe file that defines the model, when it is not one of this "
        "repository's recipes (e.g. your own copy): the file is imported, so name only one you trust",
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m common.tools.predict",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_arguments(parser)
    parser.add_argument("inputs", nargs="+", help="image files or folders of images")
    parser.add_argument("--top-k", type=int, default=3, help="how many classes to list per image (default 3)")
    parser.add_argument("--format", choices=("table", "json", "csv"), default="table", help="output format")
    parser.add_argument("--output", help="write the output to this file instead of stdout")
    parser.add_argument("--batch-size", type=int, default=64, help="images per forward pass (default 64)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    parser.add_argument(
        "--no-tta", action="store_true", help="no test-time augmentation even if the run evaluated with it"
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    if args.top_k < 1:
        raise RecipeError(f"--top-k must be at least 1 (got {args.top_k}).")
    if args.batch_size < 1:
        raise RecipeError(f"--batch-size must be at least 1 (got {args.batch_size}).")
    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        raise RecipeError(f"--device {args.device!r} is not a torch device ({err}). Use cpu or cuda.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RecipeError(f"--device {args.device} was asked for but CUDA is not available here. Use --device cpu.")
    predictor = load_predictor(args.model, device, tta=0 if args.no_tta else None, recipe_file=args.recipe)
    files = collect_images(args.inputs)
    resized = []
    results = predict_files(predictor, files, args.top_k, args.batch_size, on_resize=resized.append)
    c, h, w = predictor.input_shape
    card = predictor.card
    print(
        f"model: {printable(predictor.model_dir)} ({printable(card.get('model'))}, recipe "
        f"{printable(card.get('recipe'))}, input {c}x{h}x{w}, tta level {predictor.tta}); {len(results)} image(s)",
        file=sys.stderr,
    )
    if resized:
        print(
            f"note: {len(resized)} image(s) were not {w}x{h} and were resized bilinearly (e.g. "
            f"{printable(resized[0])}); accuracy may differ from the run's if it trained on another size.",
            file=sys.stderr,
        )
    text = {"table": format_table, "csv": format_csv}.get(args.format, lambda r: format_json(r, predictor))(results)
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as err:
            raise RecipeError(
                f"Could not write --output {args.output}: {err.strerror or err}. Pass a path in "
                "an existing, writable folder."
            ) from None
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def main(argv=None) -> int:
    return run_command(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
