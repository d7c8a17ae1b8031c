"""The trajectory viewer in a real headless browser (Debian's chromium driven by PyPI playwright):
multi-turn tool episodes from several steps of a run — step-by-step navigation, the conversation
view (model turns, tool calls, environment replies), the token view (masked vs sampled), and the
failure reasons, shown and filterable. Skips, saying why, where no browser can be started."""

from __future__ import annotations

import os
import shutil

import pytest

from palaestra.orchestrator.viewer import write_trajectory_viewer
from palaestra.sample import Sample, sample_id_for

pytestmark = pytest.mark.browser


def _chromium() -> str | None:
    return (
        os.environ.get("PALAESTRA_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    )


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("PyPI playwright is not installed (pip install playwright==1.65.2)")
    executable = _chromium()
    if executable is None:
        pytest.skip("no chromium executable (apt-get install chromium, or set PALAESTRA_CHROMIUM)")
    with sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        except Exception as exc:  # a browser that cannot start here (no display libraries, ...)
            pytest.skip(f"chromium at {executable} does not start: {exc}")
        yield b
        b.close()


def _episode(tok, step: int, index: int, failures: dict[str, float]) -> dict:
    """A code_sandbox-like episode: tool call, tool result, another call, result, answer."""
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = enc(f"<|im_start|>user\nWrite f (task {step}-{index}).<|im_end|>\n<|im_start|>assistant\n")
    sample = Sample(
        sample_id=sample_id_for(f"s{step}-{index}", 0),
        session_id=f"s{step}-{index}",
        group_id=f"code/t{index}/r",
        env="code",
        task_id=f"t{index}",
        tokens=list(prompt),
        prompt_len=len(prompt),
        reward=1.0 if not failures else 0.0,
        metrics={"correct": float(not failures), **{f"failure/{k}": v for k, v in failures.items()}},
    )
    call = (
        '<tool_call>\n{"name": "run_python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call><|im_end|>'
    )
    for k, (said, result) in enumerate([(call, "42"), (call, "exit code 0")]):
        out = enc(("Let me test it.\n" if k == 0 else "") + said)
        sample.append(out, sampled=True, logprobs=[-0.2] * len(out), weight_version=str(step))
        sample.append(
            enc(
                f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
            ),
            sampled=False,
        )
    answer = enc("```python\ndef f():\n    return 42\n```<|im_end|>")
    sample.append(answer, sampled=True, logprobs=[-0.1] * len(answer), weight_version=str(step))
    return {**sample.to_dict(), "step": step}


@pytest.fixture(scope="module")
def page_path(tok, tmp_path_factory):

    failures = [{}, {"tool_call_parse": 1.0}, {"sandbox_timeout": 2.0, "no_answer": 1.0}]
    samples = [_episode(tok, step, i, failures[(step + i) % 3]) for step in (1, 2, 3) for i in range(3)]
    path = tmp_path_factory.mktemp("viewer") / "viewer.html"
    return write_trajectory_viewer(samples, tok, path, title="run: all steps"), samples


def test_viewer_shows_tool_episodes_steps_and_failures(browser, page_path):
    path, samples = page_path
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.goto(path.as_uri())

    assert page.locator("#rows tr:not([hidden])").count() == 9
    assert page.inner_text("#shown") == "showing 9 of 9"

    # The question is shown with its answer: the prompt is open above the conversation.
    assert page.locator("#prompt").is_visible() and "Write f (task 1-0)" in page.inner_text("#prompt")
    # A clean episode's failures cell is a neutral dash; a failed one's is red.
    clean = next(i for i, s in enumerate(samples) if s["reward"] == 1.0)
    cell = page.locator(f'#rows tr[data-i="{clean}"] td').nth(4)
    assert (
        cell.inner_text() == "—" and cell.evaluate("td => getComputedStyle(td).color") == "rgb(158, 158, 158)"
    )
    red = page.locator("#rows tr td.fail").first.evaluate("td => getComputedStyle(td).color")
    assert red == "rgb(198, 40, 40)"

    # The first sample opens as a conversation: 3 model turns (tool calls marked), 2 environment replies.
    assert page.locator(".turn.model").count() == 3 and page.locator(".turn.env").count() == 2
    assert "<tool_response>" in page.locator(".turn.env").first.inner_text()
    assert page.locator(".turn.model .call").count() == 2
    assert "run_python" in page.locator(".turn.model .call").first.inner_text()
    assert "sampled tokens (loss_mask 1)" in page.locator(".turn.model h3").first.inner_text()

    # A failed episode says why, in the row and in the detail.
    failed = next(i for i, s in enumerate(samples) if s["metrics"].get("failure/sandbox_timeout"))
    row = page.locator(f'#rows tr[data-i="{failed}"]')
    assert "no_answer, sandbox_timeout" in row.inner_text()
    row.click()
    assert page.locator("#why").is_visible()
    assert page.inner_text("#why") == "what went wrong: no_answer, sandbox_timeout"
    page.click("#metrics-box summary")
    assert "failure/sandbox_timeout = 2.000" in page.inner_text("#metrics")

    # The token view: every response token, masked ones marked; no teacher, so no teacher colouring.
    page.check("input[name=view][value=tokens]")
    assert page.locator("#turns").is_hidden() and page.locator("#tokens").is_visible()
    assert page.locator("#colour-by").is_hidden() and page.locator("#legend-mask").is_visible()
    response = len(samples[failed]["tokens"]) - samples[failed]["prompt_len"]
    assert page.locator("#tokens span").count() == response
    assert page.locator("#tokens span.m0").count() == response - sum(samples[failed]["loss_mask"])

    # Step by step over the whole run, and back.
    for expected in ("1", "2", "3", "3"):
        page.click("#next-step")
        assert page.input_value("#step") == expected
        steps = page.locator("#rows tr:not([hidden])").evaluate_all("rows => rows.map(r => r.dataset.step)")
        assert steps == [expected] * 3
    page.click("#prev-step")
    assert page.input_value("#step") == "2"
    page.select_option("#step", "*")

    # Filter by failure: only the episodes that had it; "none" only the clean ones.
    page.select_option("#failure", "tool_call_parse")
    shown = page.locator("#rows tr:not([hidden])").evaluate_all("rows => rows.map(r => Number(r.dataset.i))")
    assert shown == [i for i, s in enumerate(samples) if s["metrics"].get("failure/tool_call_parse")]
    page.select_option("#failure", "-")
    shown = page.locator("#rows tr:not([hidden])").evaluate_all("rows => rows.map(r => Number(r.dataset.i))")
    assert shown == [i for i, s in enumerate(samples) if s["reward"] == 1.0]
    assert not errors, errors


def test_student_teacher_colouring_is_offered_only_with_teacher_logprobs(browser, page_path, tok, tmp_path):
    _, samples = page_path
    taught = [{**s, "teacher_logprobs": [lp - 0.5 for lp in s["rollout_logprobs"]]} for s in samples[:2]]
    path = write_trajectory_viewer(taught, tok, tmp_path / "viewer.html", title="run: with a teacher")
    page = browser.new_page()
    page.goto(path.as_uri() + "#mode=gap")
    assert page.locator("#colour-by").is_visible() and page.locator("#legend-gap").is_visible()
    assert page.locator("#tokens span[style]").count() > 0  # coloured by the gap
    untaught = write_trajectory_viewer(samples[:2], tok, tmp_path / "plain.html", title="run")
    page.goto(untaught.as_uri() + "#mode=gap")  # asked for, but there is nothing to colour by
    assert page.locator("#colour-by").is_hidden() and page.locator("#legend-gap").is_hidden()
    assert page.locator("#tokens span.m1").count() > 0  # the loss mask instead
