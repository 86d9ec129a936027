"""The results table of README.md and docs/results.md, rendered from the measured figures in benchmarks/results/.

Each measured figure is kept once, as data: one JSON file per study and machine (``recipes-machine-c.json``, ...),
whose ``schema`` is ``accelerate-recipes results 1`` (any other JSON file there, such as a benchmark's own report, is
left alone). A file holds its ``machine`` (name, description, ``lscpu`` flags, precision), its ``source`` and its
``rows``; a row holds the recipe, its setting and the flags that give it (``default``: the recipe's defaults;
``readme``: shown in README.md), the data, the seeds with their validation accuracy and wall seconds (launch to
exit; ``wall_s_range`` where only a range was recorded; ``shared_machine`` per seed), the baseline measured beside
it (seconds, and its accuracy where recorded), the date, versions and git revision where recorded (each table names
the revision, the first commit that recorded figures measured without one, ``revision_recorded``, or says it was not
recorded), the script that measures it and its command. Means are computed here
from the seeds' figures.

    python benchmarks/results_table.py            # print README's table
    python benchmarks/results_table.py --all      # print docs/results.md's table (every row)
    python benchmarks/results_table.py --write    # rewrite both tables between their markers
    python benchmarks/results_table.py --check    # exit 1 when a table differs from the data

README.md shows the rows marked ``"readme": true``; docs/results.md shows every row. The table sits between
``<!-- results:begin -->`` and ``<!-- results:end -->``.
"""

from __future__ import annotations

import argparse
import json
import sys
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
SCHEMA = "accelerate-recipes results 1"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
RECIPES = ("mnist_convnet", "fashion_mnist_mlp", "cifar_cnn", "finetune_folder")
HEADER = (
    "| recipe, setting | data | validation accuracy, per seed | mean | wall, launch to exit "
    "| baseline beside it: wall (accuracy) | machine, precision, date, versions |"
)
SEPARATOR = "|---|---|---|---|---|---|---|"
SHARED = "\\* another job shared the machine for part of that run."


def load(results_dir: Path = RESULTS) -> list[dict]:
    """Every results file's rows, each with its file's machine and file name, in the table's order."""
    rows = []
    for path in sorted(results_dir.glob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            continue
        for i, row in enumerate(data["rows"]):
            rows.append({**row, "machine": data["machine"], "file": path.name, "position": i})
    machines = {}
    for row in rows:
        if machines.setdefault(row["machine"]["name"], row["machine"]) != row["machine"]:
            raise ValueError(f"machine {row['machine']['name']} is described two ways ({row['file']} and another file)")
    order = {name: i for i, name in enumerate(RECIPES)}
    return sorted(
        rows,
        key=lambda r: (
            order.get(r["recipe"], len(order)),
            not r["default"],
            not r["readme"],
            r["machine"]["name"],
            r["file"],
            r["position"],
        ),
    )


def _number(x) -> str:
    """A figure as recorded: 640 stays 640, 99.40 keeps its two decimals (JSON reads it as 99.4)."""
    return str(x)


def _pct(values: list) -> list[str]:
    return [f"{Decimal(str(v)):.2f}" for v in values]


def mean_pct(values: list) -> str:
    """The mean of percentages given to two decimals, rounded half up to two decimals."""
    total = sum(Decimal(str(v)) for v in values)
    return str((total / len(values)).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))


def _seconds(values: list, shared: list | None = None) -> str:
    shared = shared or [False] * len(values)
    return ", ".join(_number(v) + ("\\*" if s else "") for v, s in zip(values, shared))


def _seeds(seeds: list) -> str:
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    if seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"seeds {seeds[0]}-{seeds[-1]}"
    return "seeds " + ", ".join(map(str, seeds))


def _setting(row: dict) -> str:
    text = f"`{row['recipe']}`, {row['setting']}"
    return text + (f" (`{row['flags']}`)" if row["flags"] else "")


def _wall(row: dict) -> str:
    if row.get("wall_s"):
        return _seconds(row["wall_s"], row.get("shared_machine")) + " s"
    low, high = row["wall_s_range"]
    return f"{_number(low)}-{_number(high)} s"


def _baseline(row: dict) -> str:
    b = row.get("baseline")
    if not b:
        return ""
    text = f"{b['short']}: {_seconds(b['wall_s'], b.get('shared_machine'))} s"
    if b.get("accuracy_pct"):
        acc = _pct(b["accuracy_pct"])
        text += f" ({', '.join(acc)}%" + (f"; mean {mean_pct(b['accuracy_pct'])}%)" if len(acc) > 1 else ")")
    return text


def _machine(row: dict) -> str:
    parts = [f"{row['machine']['name']}, {row['machine']['precision']}"]
    parts += [row["date"]] if row.get("date") else []
    parts += [_revision(row)]
    parts += [f"{name} {version}" for name, version in sorted(row.get("versions", {}).items())]
    return ", ".join(parts)


def _revision(row: dict) -> str:
    """The revision measured, or, for figures recorded without it (``revision_recorded``), the first commit that
    records them: measured at that revision or before it."""
    if not row.get("revision"):
        return "revision not recorded"
    return f"recorded at {row['revision']}" if row.get("revision_recorded") else f"revision {row['revision']}"


def _mean(row: dict) -> str:
    if len(row["accuracy_pct"]) < 2:
        return ""
    mean = f"{mean_pct(row['accuracy_pct'])}%"
    return f"**{mean}**" if row["readme"] else mean


def _line(row: dict) -> str:
    cells = [
        _setting(row),
        row["data"],
        f"{', '.join(_pct(row['accuracy_pct']))}% ({_seeds(row['seeds'])})",
        _mean(row),
        _wall(row),
        _baseline(row),
        _machine(row),
    ]
    return "| " + " | ".join(cells) + " |"


def _machines(rows: list[dict]) -> list[str]:
    seen = {}
    for row in rows:
        seen.setdefault(row["machine"]["name"], row["machine"])
    return [
        f"- **{m['name']}**: {m['description']} with `lscpu` flags `{m['cpu_flags']}`: {m['note']}."
        for _, m in sorted(seen.items())
    ]


README_HEADER = (
    "| recipe, setting | validation accuracy | wall, launch to exit | beside it, same machine and split | machine |"
)
README_SEPARATOR = "|---|---|---|---|---|"


def _median(values: list) -> str:
    ordered = sorted(values)
    middle = (
        ordered[len(ordered) // 2]
        if len(ordered) % 2
        else (ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    )
    return _number(round(middle, 1))


def _readme_line(row: dict) -> str:
    """README's row: the mean over the seeds with their spread, the median wall time, the baseline's median."""
    acc = row["accuracy_pct"]
    accuracy = f"**{mean_pct(acc)}%**" + (
        f" ({len(acc)} seeds: {min(_pct(acc))}-{max(_pct(acc))}%)" if len(acc) > 1 else f" ({_seeds(row['seeds'])})"
    )
    if row.get("wall_s"):
        walls = row["wall_s"]
        wall = f"{_median(walls)} s median of {len(walls)}" if len(walls) > 1 else f"{_number(walls[0])} s"
        wall += "\\*" if any(row.get("shared_machine") or []) else ""
    else:
        wall = _wall(row)
    b = row.get("baseline")
    beside = f"{b['short']}: {_median(b['wall_s'])} s" if b else ""
    machine = f"{row['machine']['name']}: 2 processes, {row['machine']['precision']}, "
    machine += _revision(row)
    return "| " + " | ".join([_setting(row), accuracy, wall, beside, machine]) + " |"


def render(results_dir: Path = RESULTS, readme: bool = True) -> str:
    """The markdown between the markers: the table (README's rows, compact, or every row), its footnote and its
    machines."""
    rows = [r for r in load(results_dir) if r["readme"] or not readme]
    if readme:
        lines = [README_HEADER, README_SEPARATOR, *(_readme_line(r) for r in rows), ""]
    else:
        lines = [HEADER, SEPARATOR, *(_line(r) for r in rows), ""]
    shared = any(
        any(r.get("shared_machine") or []) or any((r.get("baseline") or {}).get("shared_machine") or []) for r in rows
    )
    lines += [SHARED, ""] if shared else []
    return "\n".join(lines + _machines(rows))


def replace_block(text: str, block: str) -> str:
    """``text`` with what stands between its markers replaced by ``block``."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"expected one {BEGIN} ... {END} pair")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def block_of(text: str) -> str:
    """What stands between the markers of ``text``."""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


TARGETS = {REPO / "README.md": True, REPO / "docs" / "results.md": False}  # file -> README's rows only


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help="rewrite the tables of README.md and docs/results.md")
    what.add_argument("--check", action="store_true", help="exit 1 when a table differs from the data")
    what.add_argument("--all", action="store_true", help="print the table of every row (docs/results.md's)")
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        print(render(readme=not args.all))
        return 0
    stale = []
    for path, readme in TARGETS.items():
        text = path.read_text()
        block = render(readme=readme)
        if block_of(text) != block:
            stale.append(path.relative_to(REPO))
            if args.write:
                path.write_text(replace_block(text, block))
    verb = "rewrote" if args.write else "out of date:"
    print(f"{verb} {', '.join(map(str, stale))}" if stale else "the tables match benchmarks/results/")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
