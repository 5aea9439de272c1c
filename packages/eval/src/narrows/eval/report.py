"""Base vs adapted: one row per task and metric with both values, their standard errors,
the difference and whether it exceeds two standard errors of the difference
(sqrt(se_base² + se_adapted²)). Written as JSON, a Markdown table and a bar chart."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from narrows.core.io.files import atomic_write

__all__ = ["Row", "compare", "metric_rows", "write_report"]


@dataclass(frozen=True)
class Row:
    task: str
    metric: str
    base: float
    base_stderr: float | None
    adapted: float
    adapted_stderr: float | None
    higher_is_better: bool | None

    @property
    def difference(self) -> float:
        return self.adapted - self.base

    @property
    def stderr(self) -> float | None:
        if self.base_stderr is None or self.adapted_stderr is None:
            return None
        return math.sqrt(self.base_stderr**2 + self.adapted_stderr**2)

    @property
    def significant(self) -> bool:
        """|difference| beyond two standard errors (never, when a stderr is unknown)."""
        return self.stderr is not None and abs(self.difference) > 2 * self.stderr


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def metric_rows(results: dict) -> dict[tuple[str, str], tuple[float, float | None, bool | None]]:
    """(task, metric[,filter]) -> (value, stderr, higher_is_better) from lm-eval's results dict."""
    out = {}
    for task, metrics in results["results"].items():
        hib = results.get("higher_is_better", {}).get(task, {})
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key:
                continue
            name, filt = key.split(",", 1)
            v = _number(value)
            if v is None:
                continue
            label = name if filt == "none" else f"{name} ({filt})"
            out[(task, label)] = (v, _number(metrics.get(f"{name}_stderr,{filt}")), hib.get(name))
    return out


def compare(base: dict, adapted: dict) -> list[Row]:
    b, a = metric_rows(base), metric_rows(adapted)
    return [Row(t, m, *b[(t, m)][:2], *a[(t, m)][:2], b[(t, m)][2]) for (t, m) in b if (t, m) in a]


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


def markdown(rows: list[Row], title: str) -> str:
    lines = [
        f"# {title}",
        "",
        "| task | metric | base | adapted | difference | beyond 2 SE |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        arrow = "" if r.higher_is_better is None else (" ↑" if r.higher_is_better else " ↓")
        lines.append(
            f"| {r.task} | {r.metric}{arrow} | {_fmt(r.base)} ± {_fmt(r.base_stderr)} | {_fmt(r.adapted)} ± "
            f"{_fmt(r.adapted_stderr)} | {r.difference:+.4f} | {'**yes**' if r.significant else 'no'} |"
        )
    lines += [
        "",
        "± is lm-eval's standard error; 'beyond 2 SE' compares the difference with 2·sqrt(SE_base² + SE_adapted²).",
    ]
    return "\n".join(lines) + "\n"


def _chart(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.metric not in ("perplexity", "word_perplexity", "byte_perplexity")]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(shown)), 4))
    xs = range(len(shown))
    ax.bar(
        [x - 0.2 for x in xs],
        [r.base for r in shown],
        0.4,
        yerr=[r.base_stderr or 0 for r in shown],
        label="base",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [r.adapted for r in shown],
        0.4,
        yerr=[r.adapted_stderr or 0 for r in shown],
        label="adapted",
    )
    ax.set_xticks(
        list(xs), [f"{r.task}\n{r.metric}{' *' if r.significant else ''}" for r in shown], fontsize=7
    )
    ax.set_title(f"{title}  (* beyond 2 SE)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def write_report(rows: list[Row], folder: str | Path, *, title: str, meta: dict) -> dict[str, Path]:
    """report.json, report.md and report.png in `folder` (each written atomically)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "title": title,
        **meta,
        "rows": [
            {
                **asdict(r),
                "difference": r.difference,
                "stderr_difference": r.stderr,
                "beyond_two_stderr": r.significant,
            }
            for r in rows
        ],
    }
    paths = {"json": folder / "report.json", "markdown": folder / "report.md", "chart": folder / "report.png"}
    atomic_write(paths["json"], lambda tmp: tmp.write_text(json.dumps(data, indent=2) + "\n"))
    atomic_write(paths["markdown"], lambda tmp: tmp.write_text(markdown(rows, title)))
    _chart(rows, paths["chart"], title)
    return paths
