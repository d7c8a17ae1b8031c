"""What the model's chat template can do, probed once at start-up: its thinking switch, and where it
lets a system message stand.

Clients ask for reasoning in each dialect's words (Anthropic `thinking` and `output_config.effort`,
Responses `reasoning.effort`, chat `reasoning_effort`); an open model's only control is the chat
template's own variable, when it has one. `TemplateCaps.switch` names it:

* ``reasoning_effort`` (gpt-oss's harmony template): the effort is passed as it is ("low", ...);
* ``enable_thinking`` (Qwen3, GLM-4.5+, ...): on / off, effort "none" being off;
* None: the template has no switch; the ask is recorded as an ignored control.

Agents also put system messages in the middle of a conversation (Claude Code's system reminders,
a Responses `developer` item after the first turn). `TemplateCaps.mid_system` says how those are
rendered: ``as_is`` where the template renders a system message there (Qwen2.5, Qwen3, GLM do),
``as_user`` where it refuses one but takes the same text as a user message, or ``refuse`` where it
takes neither (then such a request is the template's 400, naming the message).

The variables are found in the template's own syntax tree (jinja2's `meta.find_undeclared_variables`),
not by searching its text; the system-message probe renders three short conversations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["SWITCHES", "TemplateCaps", "probe"]

SWITCHES = ("reasoning_effort", "enable_thinking")
"""Template variables that control reasoning, in the order they are preferred."""

MidSystem = Literal["as_is", "as_user", "refuse"]

_PROBE_TEXT = "PALAESTRA-PROBE-7f3a"


@dataclass(frozen=True)
class TemplateCaps:
    """The probed capabilities of one chat template (module docstring)."""

    switch: str | None
    """The template's reasoning variable (one of `SWITCHES`), or None."""
    mid_system: MidSystem
    """How a system message after the first message is rendered."""

    def thinking_kwargs(self, on: bool, effort: str | None) -> dict[str, Any] | None:
        """The template variables for a reasoning ask, or None when the template has no switch."""
        if self.switch == "reasoning_effort":
            if not on or effort in (None, "none"):
                return None if on else {"reasoning_effort": "low"}  # harmony has no "off": its least
            return {"reasoning_effort": effort if effort in ("low", "medium", "high") else "high"}
        if self.switch == "enable_thinking":
            return {"enable_thinking": bool(on) and effort != "none"}
        return None


def _variables(template: str) -> set[str]:
    try:
        from jinja2 import Environment, meta

        return set(meta.find_undeclared_variables(Environment().parse(template)))
    except Exception:  # a template jinja2 alone cannot parse (custom tags): no switch is assumed
        return set()


def probe(renderer: Any) -> TemplateCaps:
    """The caps of `renderer`'s template (a `renderer.ChatRenderer`)."""
    template = getattr(renderer.tokenizer, "chat_template", None)
    names = _variables(template) if isinstance(template, str) else set()
    switch = next((s for s in SWITCHES if s in names), None)
    return TemplateCaps(switch=switch, mid_system=_mid_system(renderer))


def _mid_system(renderer: Any) -> MidSystem:
    head = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    tail = [{"role": "user", "content": "go on"}]
    for mode, role in (("as_is", "system"), ("as_user", "user")):
        try:
            text = renderer.render([*head, {"role": role, "content": _PROBE_TEXT}, *tail], None)
        except Exception:
            continue
        if _PROBE_TEXT in text:
            return mode  # type: ignore[return-value]
    return "refuse"
