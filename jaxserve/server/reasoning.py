"""Reasoning parsers: split a model's thinking, `<think>...</think>`, from its answer
(`--reasoning_parser`). `split(text, final)` -> (reasoning or None, the answer's text), growing
with the text as tool-call parses do (tool_parsers/base.py): a tag's first characters and
whitespace at the edges are held back until known. Host-only.

qwen3: thinking only when the output opens with `<think>` (Qwen3 with thinking on; with
`chat_template_kwargs: {"enable_thinking": false}` its template writes an empty block into the
prompt and the output is all answer). deepseek_r1: the template opens `<think>` in the prompt,
so the output is thinking (an opening tag there is skipped) until `</think>`, all of it if that
never comes.
"""

from __future__ import annotations

from typing import ClassVar

from jaxserve.server.tool_parsers.base import held_prefix, skip_space

OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser:
    name: ClassVar[str]
    thinks_from_start: ClassVar[bool]  # the output starts inside the thinking block

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        j = skip_space(text, 0)
        if text.startswith(OPEN, j):
            j += len(OPEN)
        elif not final and j < len(text) and OPEN.startswith(text[j:]) or \
                not final and j == len(text):
            return ("" if self.thinks_from_start else None), ""  # undecided
        elif not self.thinks_from_start:
            return None, text
        else:
            j = 0
        k = text.find(CLOSE, j)
        if k < 0:
            thought = text[j:]
            if not final:
                thought = thought[:len(thought) - held_prefix(thought, (CLOSE,))].rstrip()
            return thought.strip(), ""
        return text[j:k].strip(), text[k + len(CLOSE):].lstrip()


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    thinks_from_start = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    thinks_from_start = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name in (None, "", "none"):
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: one of "
                         f"{['none', *REASONING_PARSERS]}")
    return REASONING_PARSERS[name]()
