"""`kb eval --report DIR`: the evaluation as one self-contained HTML page with plots (matplotlib, images inline):
metrics per arm and mode, per-query wins and losses against an earlier run, the search time distribution, and what
the evaluated knowledge base holds (chunk lengths, documents per format, failures)."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from pipelines.evaluation.evaluate import METRICS, latency_summary, per_query_deltas


def _png(figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(figure)
    return f'<img alt="" src="data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}">'


def _metrics_plot(results: dict) -> str:
    return _png(metrics_figure(results))


def metrics_figure(results: dict):
    """Bars per metric and configuration, the legend beside the axes: inside them it covered the tallest bars (the
    metrics near 1 are the ones a reader looks at first)."""
    import matplotlib.pyplot as plt
    import numpy as np

    configs = list(results)
    figure, axis = plt.subplots(figsize=(9, 3.2))
    width = 0.8 / max(len(configs), 1)
    for i, config in enumerate(configs):
        axis.bar(np.arange(len(METRICS)) + i * width, [results[config]["metrics"][m] for m in METRICS], width,
                 label=config)
    axis.set_xticks(np.arange(len(METRICS)) + width * (len(configs) - 1) / 2, METRICS)
    axis.set_ylim(0, 1.05)  # a bar at 1.0 clear of the frame
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    axis.set_title("metrics per arm and mode")
    return figure


def _wins_losses_plot(deltas: list[float], metric: str) -> str:
    import matplotlib.pyplot as plt

    ordered = sorted(deltas)
    figure, axis = plt.subplots(figsize=(9, 2.8))
    axis.bar(range(len(ordered)), ordered, width=1.0, color=["#c0392b" if d < 0 else "#27ae60" for d in ordered])
    axis.axhline(0, color="black", linewidth=0.5)
    axis.set_title(f"per-query {metric} difference against the earlier run (sorted)")
    axis.set_xlabel("queries")
    return _png(figure)


def _latency_plot(results: dict) -> str:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 2.8))
    for config, result in results.items():
        if result.get("latency_ms"):
            axis.hist(result["latency_ms"], bins=40, histtype="step", label=config)
    axis.set_xlabel("ms per query (evaluation search: 300 chunks, 300 over-fetched)")
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    axis.set_title("search time")
    return _png(figure)


def _bars_plot(counts: dict, title: str) -> str:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 0.4 + 0.3 * max(len(counts), 1)))
    axis.barh(list(map(str, counts)), list(counts.values()))
    axis.set_title(title)
    return _png(figure)


def _histogram_plot(values: list[int], title: str) -> str:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 2.6))
    axis.hist(values, bins=30)
    axis.set_title(title)
    return _png(figure)


def _about() -> str:
    """What a report read later must say: which kb made it, and when."""
    from datetime import datetime, timezone
    from importlib.metadata import PackageNotFoundError, version

    try:
        made_by = f"kb {version('kb')}"
    except PackageNotFoundError:
        made_by = "kb (version unknown)"
    return f"{made_by}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"


def _table(rows: list[list], header: list[str]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _answer_parts(answers: dict) -> list[str]:
    """The answer evaluation: its summary, then every question with its answer, citations and verdict."""
    a, r = answers["answers"], answers["refusals"]
    groups = ", ".join(f"{n} {g}" for g, n in answers["groups"].items() if n)
    parts = [f"<h2>answers ({answers['questions']} questions: {html.escape(groups)})</h2>",
             _table([[mode] + list(values.values()) for mode, values in answers["retrieval"].items()],
                    ["retrieval mode", *next(iter(answers["retrieval"].values()))]),
             _table([[name, value] for name, value in {**a, **{f"refusal {k}": v for k, v in r.items()},
                                                       "latency ms median": answers["latency_ms"]["median"],
                                                       "latency ms p95": answers["latency_ms"]["p95"]}.items()],
                    ["measure", "value"]),
             "<h3>every question</h3>"]
    rows = [[row["verdict"], row["group"], row["question"], " | ".join(row["expected"]) or "-", row["answer"],
             row.get("short_answer") or "-",
             "; ".join(f"{c['document']} {c['status']}" for c in row["citations"]) or "-",
             " | ".join(row["passages"]) or "-", f"{row['confidence']:.2f}"] for row in answers["per_question"]]
    parts.append(_table(rows, ["verdict", "group", "question", "expected", "answer", "short answer", "citations",
                               "gold passages", "confidence"]).replace("<table>", '<table class="questions">'))
    return parts


def write_report(report: dict, directory: Path) -> Path:
    """report: `kb eval`'s per-dataset results, with per_query and latency_ms still in them."""
    import matplotlib

    matplotlib.use("Agg")
    directory.mkdir(parents=True, exist_ok=True)
    parts = ["<h1>kb eval</h1>", f"<p class=about>{html.escape(_about())}</p>"]
    for name, data in report.items():
        if name == "answers":
            continue
        results = data["results"]
        parts.append(f"<h2>{html.escape(name)} ({html.escape(data['split'])}, {data['queries']} queries)</h2>")
        if data.get("model"):
            parts.append(f"<p>embedding model {html.escape(data['model'])}"
                         + (f"; reranker {html.escape(data['reranker'])}" if data.get("reranker") else "") + "</p>")
        parts.append(_table([[cfg] + [f"{r['metrics'][m]:.4f}" for m in METRICS] + [
            "{median:.1f} / {p95:.1f}".format(**latency_summary(r["latency_ms"])) if r.get("latency_ms") else "-"] for cfg, r in results.items()], ["configuration", *METRICS, "ms median / p95"]))
        parts.append(_metrics_plot(results))
        for cfg, result in results.items():
            compared = result.get("compared", {}).get("ndcg@10")
            if compared:
                deltas = per_query_deltas(result["earlier"], result["per_query"])
                parts.append(f"<h3>{html.escape(cfg)} against the earlier run</h3><p>nDCG@10 {compared['before']:.4f} ->"
                             f" {compared['after']:.4f}, per query {compared['mean_delta']:+.4f} +/-"
                             f" {compared['standard_error']:.4f}: {compared['wins']} wins, {compared['losses']} losses,"
                             f" {compared['ties']} ties</p>" + _wins_losses_plot(deltas, "nDCG@10"))
        parts.append(_latency_plot(results))
        for cfg, result in results.items():
            if result.get("groups"):
                parts.append(f"<h3>{html.escape(cfg)} by query kind</h3>" + _table(
                    [[group] + [f"{values[m]:.4f}" for m in METRICS] + [values["queries"]]
                     for group, values in result["groups"].items()], ["group", *METRICS, "queries"]))
        stats = data.get("statistics", {})
        if stats:
            parts.append("<h3>what the evaluated knowledge base holds</h3>")
            parts.append(_histogram_plot(stats["chunk_tokens"], "model tokens per chunk"))
            parts.append(_bars_plot(stats["documents_per_format"], "documents per format"))
            parts.append(_bars_plot(stats["failures_per_stage"], "failing documents per stage")
                         if stats["failures_per_stage"] else "<p>no failing documents</p>")
    if "answers" in report:
        parts += _answer_parts(report["answers"])
    page = directory / "index.html"
    style = ("body{font-family:system-ui,sans-serif;max-width:64rem;margin:2rem auto;color:#222}"
             "table{border-collapse:collapse;margin:.5rem 0}td,th{border:1px solid #ccc;padding:.2rem .5rem;"
             "font-size:.85rem;text-align:right}th{background:#f4f6fa}img{display:block;margin:.5rem 0}"
             ".about{color:#666}.questions td{text-align:left;vertical-align:top}")
    page.write_text(f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>kb eval</title><style>{style}"
                    f"</style></head><body>{''.join(parts)}</body></html>")
    return page
