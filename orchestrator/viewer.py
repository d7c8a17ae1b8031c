"""The static trajectory viewer: one HTML file of a step's samples, token by token.

    from palaestra.orchestrator.viewer import write_trajectory_viewer
    write_trajectory_viewer([s.to_dict() for s in samples], tokenizer, "runs/demo/viewer.html",
                            title="demo: last step")

One HTML file with inline CSS and JS and no network access: a list of samples filterable by step
(with step-by-step navigation), reward, status, failure and fork reason and, for the selected one,
what went wrong (its ``failure/*`` metrics), the conversation (model turns with their tool calls,
environment replies, masked vs sampled) or its response tokens coloured by loss mask
(policy-sampled vs environment/template tokens) or by the student−teacher logprob gap. Token
strings are embedded once per sample as JSON and put on the page with `textContent`, so whatever
the model wrote (`<script>` included) stays text.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from palaestra.sample import Sample

__all__ = ["token_texts", "write_trajectory_viewer"]


def token_texts(tokenizer, ids: Sequence[int], start: int = 0) -> list[str]:
    """The text each of `ids[start:]` adds, decoded in context (incremental detokenization).

    Decoding tokens one by one breaks multi-byte characters and drops sentencepiece's leading
    spaces, so each token's text is the growth of a decoded window that starts a few tokens
    earlier; a token that ends inside a character gets "" and the next one carries the character.
    """
    ids = list(ids)
    texts: list[str] = []
    prefix, read = max(start - 5, 0), start
    for i in range(start, len(ids)):
        before = tokenizer.decode(ids[prefix:read], skip_special_tokens=False)
        after = tokenizer.decode(ids[prefix : i + 1], skip_special_tokens=False)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            texts.append(after[len(before) :])
            prefix, read = read, i + 1
        else:
            texts.append("")
    return texts


FAILURE_PREFIX = "failure/"


def failures_of(sample: Mapping[str, Any]) -> list[str]:
    """What went wrong in the sample's episode: the ``failure/<name>`` metrics that are non-zero
    (the tool environments' named failures), and ``error`` when the episode raised."""
    metrics = sample.get("metrics") or {}
    names = [
        k.removeprefix(FAILURE_PREFIX)
        for k, v in sorted(metrics.items())
        if k.startswith(FAILURE_PREFIX) and v
    ]
    if metrics.get("error"):
        names.append("error")
    return names


def conversation(texts: Sequence[str], mask: Sequence[int]) -> list[dict[str, Any]]:
    """The response as alternating runs: what the policy sampled (a model turn, its tool calls
    included) and what the environment added (tool results, the template between turns)."""
    runs: list[dict[str, Any]] = []
    for text, m in zip(texts, mask, strict=True):
        who = "model" if m else "env"
        if runs and runs[-1]["who"] == who:
            runs[-1]["text"] += text
            runs[-1]["n"] += 1
        else:
            runs.append({"who": who, "text": text, "n": 1})
    return runs


def _rounded(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None  # JSON has no inf; shown as "–"


def _sample_record(sample: Mapping[str, Any], tokenizer, index: int) -> dict[str, Any]:
    """What the page's script needs of one sample: token strings once, mask, logprobs, gaps."""
    tokens, prompt_len = list(sample["tokens"]), int(sample["prompt_len"])
    mask = [int(m) for m in sample.get("loss_mask") or []]
    rollout = list(sample.get("rollout_logprobs") or [])
    teacher = sample.get("teacher_logprobs")
    gap = None
    if teacher is not None:
        # student − teacher only where both exist: masked tokens carry no rollout logprob.
        gap = [
            _rounded(r - t) if m == 1 and t is not None else None
            for r, t, m in zip(rollout, teacher, mask, strict=True)
        ]
    texts = token_texts(tokenizer, tokens, prompt_len)
    return {
        "id": str(sample.get("sample_id", index)),
        "prompt": tokenizer.decode(tokens[:prompt_len], skip_special_tokens=False),
        "tok": texts,
        "turns": conversation(texts, mask),
        "failures": failures_of(sample),
        "metrics": {k: _rounded(float(v)) for k, v in sorted((sample.get("metrics") or {}).items())},
        "step": sample.get("step"),
        "mask": mask,
        "lp": [_rounded(x) if m == 1 else None for x, m in zip(rollout, mask, strict=True)],
        "gap": gap,
        "teacher": sample.get("teacher"),
    }


def _script_json(value: Any) -> str:
    """JSON that is safe inside <script>: no `<`, `>` or `&` survive, so no `</script>` can occur."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def _cell(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def write_trajectory_viewer(
    samples: Sequence[Mapping[str, Any] | Sample], tokenizer, path: str | Path, *, title: str
) -> Path:
    """One self-contained HTML file: the samples (`Sample`s or their `to_dict()`), filterable by
    step, reward range, status, failure and fork reason; the selected one with its prompt open, as a
    conversation (each model turn with its tool calls, each environment reply, masked vs sampled)
    or as tokens coloured by loss mask or, when some sample has teacher logprobs, by the
    student−teacher logprob gap (a page without any offers no such colouring).
    A dict may carry ``step`` (an int): then the page navigates the run step by step."""
    samples = [s.to_dict() if isinstance(s, Sample) else s for s in samples]
    records = [_sample_record(s, tokenizer, i) for i, s in enumerate(samples)]
    gaps = sorted(abs(g) for r in records for g in (r["gap"] or []) if g is not None)
    # The colour scale saturates at the 95th percentile of |gap| (at least 0.5 nats), so a few
    # extreme tokens do not wash out the rest; the legend states the bound.
    scale = max(0.5, round(gaps[int(0.95 * (len(gaps) - 1))], 1)) if gaps else 1.0
    reasons = sorted({s.get("fork_reason") or "" for s in samples})
    statuses = sorted({str(s.get("status", "")) for s in samples})
    failures = sorted({f for r in records for f in r["failures"]})
    steps = sorted({s["step"] for s in samples if isinstance(s.get("step"), int)})

    rows = []
    for i, s in enumerate(samples):
        reward = float(s.get("reward", 0.0))
        response = len(s["tokens"]) - int(s["prompt_len"])
        step = s.get("step")
        failed = records[i]["failures"]
        rows.append(
            f'<tr data-i="{i}" data-reward="{reward!r}" data-status="{_cell(s.get("status"))}" '
            f'data-fork="{_cell(s.get("fork_reason") or "")}" data-step="{_cell(step)}" '
            f'data-failures="{_cell(" ".join(failed))}"><td>{i}</td><td>{_cell(step if step is not None else "—")}</td>'
            f"<td>{reward:.3f}</td><td>{_cell(s.get('status'))}</td>"
            f'<td class="{"fail" if failed else "none"}">{_cell(", ".join(failed) or "—")}</td>'
            f"<td>{_cell(s.get('fork_reason') or '—')}</td>"
            f"<td>{_cell(s.get('env'))}</td><td>{_cell(s.get('task_id'))}</td>"
            f"<td>{response}</td><td>{sum(records[i]['mask'])}</td>"
            f'<td class="mono">{_cell(s.get("sample_id"))}</td></tr>'
        )
    rewards = [float(s.get("reward", 0.0)) for s in samples] or [0.0]
    fork_options = "".join(
        f'<option value="{_cell(r)}">{_cell(r or "none (first sample of a session)")}</option>'
        for r in reasons
    )
    status_options = "".join(f'<option value="{_cell(s)}">{_cell(s)}</option>' for s in statuses)
    failure_options = "".join(f'<option value="{_cell(f)}">{_cell(f)}</option>' for f in failures)
    step_options = "".join(f'<option value="{n}">step {n}</option>' for n in steps)
    slots = {
        "TITLE": html.escape(title),
        "COUNT": str(len(samples)),
        "ROWS": "\n".join(rows),
        "FORK_OPTIONS": fork_options,
        "STATUS_OPTIONS": status_options,
        "FAILURE_OPTIONS": failure_options,
        "STEP_OPTIONS": step_options,
        "RMIN": repr(min(rewards)),
        "RMAX": repr(max(rewards)),
        "SCALE": f"{scale:g}",
        "DATA": _script_json({"samples": records, "scale": scale, "steps": steps, "teacher": bool(gaps)}),
    }
    # One pass, so text inside a slot (a task id, a token) is never taken for another slot.
    page = re.sub(r"__([A-Z_]+)__", lambda m: slots[m.group(1)], _PAGE)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
[hidden]{display:none!important}
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{padding:10px 16px;background:#263238;color:#fff}
header h1{font-size:18px;margin:0}
header p{margin:2px 0 0;color:#b0bec5;font-size:12px}
#filters{padding:8px 16px;background:#eceff1;display:flex;gap:16px;flex-wrap:wrap;align-items:center}
#filters input[type=number]{width:6em}
main{display:grid;grid-template-columns:minmax(320px,42%) 1fr;height:calc(100vh - 100px)}
#list{overflow:auto;border-right:1px solid #cfd8dc}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{padding:3px 6px;text-align:left;border-bottom:1px solid #eceff1;white-space:nowrap}
th{position:sticky;top:0;background:#fff}
tbody tr{cursor:pointer}
tbody tr:hover{background:#e3f2fd}
tbody tr.sel{background:#bbdefb}
.mono{font-family:ui-monospace,monospace;font-size:11px;color:#607d8b}
#detail{overflow:auto;padding:10px 16px}
#meta{margin:0 0 8px}
#tokens{font-family:ui-monospace,monospace;font-size:13px;white-space:pre-wrap;word-break:break-word;
 background:#fff;border:1px solid #cfd8dc;padding:8px;line-height:1.7}
#tokens span{border-radius:2px;box-shadow:inset -1px 0 0 rgba(255,255,255,.9)}
.m1{background:#c8e6c9}
.m0{background:#eeeeee;color:#757575}
.nogap{color:#9e9e9e}
.legend{display:flex;gap:12px;align-items:center;margin:6px 0;font-size:12px;flex-wrap:wrap}
.sw{display:inline-block;width:14px;height:14px;border:1px solid #bbb;vertical-align:middle;margin-right:4px}
#bar{width:200px;height:12px;background:linear-gradient(90deg,rgb(33,102,172),#fff,rgb(178,24,43));border:1px solid #bbb}
details{margin:8px 0}
details pre{white-space:pre-wrap;word-break:break-word;background:#fff;border:1px solid #cfd8dc;padding:8px;font-size:12px}
.empty{color:#777;padding:16px}
.turn{border:1px solid #cfd8dc;border-left-width:6px;margin:6px 0;background:#fff}
.turn h3{margin:0;padding:3px 8px;font-size:12px;font-weight:600;background:#f5f5f5}
.turn pre{margin:0;padding:6px 8px;white-space:pre-wrap;word-break:break-word;font-size:12px}
.turn.model{border-left-color:#43a047}
.turn.env{border-left-color:#9e9e9e;color:#555}
.turn .call{background:#fff3e0}
#why{background:#ffebee;border:1px solid #ef9a9a;padding:6px 8px;margin:6px 0}
td.fail{color:#c62828}
td.none{color:#9e9e9e}
</style></head>
<body>
<header><h1>__TITLE__</h1><p>__COUNT__ samples &middot; click one to see its tokens</p></header>
<div id="filters">
 <label>reward from <input id="rmin" type="number" step="any" value="__RMIN__"></label>
 <label>to <input id="rmax" type="number" step="any" value="__RMAX__"></label>
 <label>fork reason <select id="fork"><option value="*">any</option>__FORK_OPTIONS__</select></label>
 <label>status <select id="status"><option value="*">any</option>__STATUS_OPTIONS__</select></label>
 <label>failure <select id="failure"><option value="*">any</option><option value="-">none</option>__FAILURE_OPTIONS__</select></label>
 <span><button id="prev-step" type="button">&#9664;</button>
 <label>step <select id="step"><option value="*">all</option>__STEP_OPTIONS__</select></label>
 <button id="next-step" type="button">&#9654;</button></span>
 <span id="shown"></span>
</div>
<main>
<div id="list"><table><thead><tr><th>#</th><th>step</th><th>reward</th><th>status</th><th>failures</th>
<th>fork reason</th><th>env</th>
<th>task</th><th>resp. tokens</th><th>sampled</th><th>sample id</th></tr></thead>
<tbody id="rows">
__ROWS__
</tbody></table></div>
<div id="detail">
 <div class="legend"><b>show</b>
  <label><input type="radio" name="view" value="turns" checked> conversation</label>
  <label><input type="radio" name="view" value="tokens"> tokens</label>
 </div>
 <div class="legend" id="colour-by" hidden><b>colour by</b>
  <label><input type="radio" name="mode" value="mask" checked> loss mask</label>
  <label><input type="radio" name="mode" value="gap"> student − teacher logprob</label>
 </div>
 <div class="legend" id="legend-mask"><span><span class="sw m1"></span>sampled by the policy (loss_mask 1)</span>
  <span><span class="sw m0"></span>environment / template tokens (loss_mask 0)</span></div>
 <div class="legend" id="legend-gap" hidden><span>teacher more likely (−__SCALE__ nats)</span><span id="bar"></span>
  <span>student more likely (+__SCALE__ nats)</span><span class="nogap">grey: no teacher logprob or not sampled</span></div>
 <div id="meta" class="empty">Select a sample on the left.</div>
 <div id="why" hidden></div>
 <details id="metrics-box"><summary>metrics</summary><pre id="metrics"></pre></details>
 <details id="prompt-box" open><summary>prompt</summary><pre id="prompt"></pre></details>
 <div id="turns"></div>
 <div id="tokens" hidden></div>
</div>
</main>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const $ = (id) => document.getElementById(id);
let current = null;

function mode() { return document.querySelector("input[name=mode]:checked").value; }

function gapColour(g) {
  const t = Math.max(-1, Math.min(1, g / DATA.scale));
  const [r, gr, b] = t < 0 ? [33, 102, 172] : [178, 24, 43];
  const a = Math.abs(t);
  const mix = (c) => Math.round(255 + (c - 255) * a);
  return "rgb(" + mix(r) + "," + mix(gr) + "," + mix(b) + ")";
}

function fmt(x) { return x === null || x === undefined ? "–" : x.toFixed(3); }

function view() { return document.querySelector("input[name=view]:checked").value; }

// The parts of a model turn that are tool calls, in the chat formats the gateway parses.
const CALL = /(<tool_call>[\\s\\S]*?(?:<\\/tool_call>|$)|<\\|tool_call[\\s\\S]*?(?:<\\|\\/tool_call\\|>|$))/;

function renderTurns(s) {
  const box = $("turns");
  box.textContent = "";
  let modelTurn = 0;
  s.turns.forEach((t) => {
    const div = document.createElement("div");
    div.className = "turn " + t.who;
    const h = document.createElement("h3");
    if (t.who === "model") modelTurn++;
    h.textContent = t.who === "model"
      ? "model turn " + modelTurn + " · " + t.n + " sampled tokens (loss_mask 1)"
      : "environment · " + t.n + " tokens: tool results, template (loss_mask 0)";
    const pre = document.createElement("pre");
    t.text.split(CALL).forEach((part, k) => {
      if (!part) return;
      const span = document.createElement("span");
      span.textContent = part;
      if (k % 2 === 1 && t.who === "model") { span.className = "call"; span.title = "tool call"; }
      pre.appendChild(span);
    });
    div.append(h, pre);
    box.appendChild(div);
  });
}

function render() {
  const m = mode(), v = view();
  $("turns").hidden = v !== "turns";
  $("tokens").hidden = v !== "tokens";
  $("colour-by").hidden = v !== "tokens" || !DATA.teacher;  // no teacher: the loss mask only
  $("legend-mask").hidden = v !== "tokens" || m !== "mask";
  $("legend-gap").hidden = v !== "tokens" || m !== "gap";
  if (current === null) return;
  const s = DATA.samples[current];
  if (v === "turns") { renderTurns(s); return; }
  const box = $("tokens");
  box.textContent = "";
  const frag = document.createDocumentFragment();
  s.tok.forEach((text, k) => {
    const span = document.createElement("span");
    span.textContent = text.replace(/\\n/g, "\\u21b5\\n");
    const gap = s.gap ? s.gap[k] : null;
    if (m === "mask") {
      span.className = s.mask[k] ? "m1" : "m0";
    } else if (gap === null) {
      span.className = "nogap";
    } else {
      span.style.background = gapColour(gap);
      if (Math.abs(gap) > 0.6 * DATA.scale) span.style.color = "#fff";  // legible on dark shades
    }
    span.title = "token " + k + (s.mask[k] ? " · sampled" : " · env/template") +
      " · logprob " + fmt(s.lp[k]) + (gap === null ? "" : " · teacher " + fmt(s.lp[k] - gap) + " · gap " + fmt(gap));
    frag.appendChild(span);
  });
  box.appendChild(frag);
}

function select(i) {
  current = i;
  document.querySelectorAll("#rows tr.sel").forEach((tr) => tr.classList.remove("sel"));
  const row = document.querySelector('#rows tr[data-i="' + i + '"]');
  if (row) row.classList.add("sel");
  const s = DATA.samples[i];
  const sampled = s.mask.reduce((a, b) => a + b, 0);
  $("meta").className = "";
  $("meta").textContent = "sample " + s.id + " · " + s.tok.length + " response tokens, " + sampled +
    " sampled · " + (s.gap ? "teacher: " + (s.teacher || "yes") : "no teacher logprobs");
  $("prompt").textContent = s.prompt;
  $("why").hidden = !s.failures.length;
  $("why").textContent = "what went wrong: " + s.failures.join(", ");
  $("metrics").textContent = Object.entries(s.metrics).map(([k, x]) => k + " = " + fmt(x)).join("\\n");
  render();
}

function applyFilters() {
  const lo = parseFloat($("rmin").value), hi = parseFloat($("rmax").value);
  const fork = $("fork").value, status = $("status").value, failure = $("failure").value, step = $("step").value;
  let shown = 0;
  document.querySelectorAll("#rows tr").forEach((tr) => {
    const r = parseFloat(tr.dataset.reward);
    const failed = tr.dataset.failures ? tr.dataset.failures.split(" ") : [];
    const ok = (isNaN(lo) || r >= lo) && (isNaN(hi) || r <= hi) &&
      (fork === "*" || tr.dataset.fork === fork) && (status === "*" || tr.dataset.status === status) &&
      (failure === "*" || (failure === "-" ? !failed.length : failed.includes(failure))) &&
      (step === "*" || tr.dataset.step === step);
    tr.hidden = !ok;
    if (ok) shown++;
  });
  $("shown").textContent = "showing " + shown + " of " + DATA.samples.length;
}

$("rows").addEventListener("click", (e) => {
  const tr = e.target.closest("tr");
  if (tr) select(Number(tr.dataset.i));
});
document.querySelectorAll("input[name=mode],input[name=view]").forEach((r) => r.addEventListener("change", render));
["rmin", "rmax", "fork", "status", "failure", "step"].forEach((id) => $(id).addEventListener("input", applyFilters));

function stepBy(delta) {  // walk the run: all -> first step, then one step at a time
  const sel = $("step"), n = sel.options.length;
  if (n <= 1) return;
  const next = sel.selectedIndex === 0 ? (delta > 0 ? 1 : n - 1) : sel.selectedIndex + delta;
  sel.selectedIndex = Math.max(1, Math.min(n - 1, next));
  applyFilters();
  const firstShown = document.querySelector("#rows tr:not([hidden])");
  if (firstShown) select(Number(firstShown.dataset.i));
}
$("prev-step").addEventListener("click", () => stepBy(-1));
$("next-step").addEventListener("click", () => stepBy(1));
// A link can open a given sample and colouring: viewer.html#sample=3&mode=gap
const want = new URLSearchParams(location.hash.slice(1));
if (want.get("mode") === "gap" && DATA.teacher) document.querySelector("input[name=mode][value=gap]").checked = true;
if (want.get("mode") || want.get("view") === "tokens") document.querySelector("input[name=view][value=tokens]").checked = true;
if (want.get("step")) { $("step").value = want.get("step"); }
applyFilters();
const first = Number(want.get("sample") || 0);
if (DATA.samples.length) select(first < DATA.samples.length ? first : 0);
</script>
</body></html>
"""
