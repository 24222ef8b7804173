"""A chat as both front ends take it: `Conversation` holds what reaches the chat template
(messages, tools, add_generation_prompt, continue_final_message, chat_template_kwargs) with its
parts' shapes and the rules between them, and renders it through the tokenizer. The server's chat
body extends it (server/requests.py's ChatCompletionRequest) and LLM.chat validates its arguments
with it, so both refuse the same conversations with the same messages. Host-only.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from jaxserve.json_models import FieldError, JsonObject, NonEmpty, first_error, one_error
from jaxserve.tokenizer import reserved_template_names

# What a chat's own fields pass to its template.
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token",
                                "eos_token"})


class TextPart(JsonObject):
    type: Literal["text"]
    text: str


class FunctionCall(JsonObject):
    name: NonEmpty
    arguments: Annotated[str | dict[str, Any], one_error(
        "must be the arguments' JSON text (or a JSON object)")] = "{}"


class ToolCall(JsonObject):
    """An earlier call of an assistant message, rendered by templates (or tool_prompt.py)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(JsonObject):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart], one_error(
        "must be a string or a list of text parts {'type': 'text', 'text': ...} (only text "
        "parts are supported)")] = ""
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict:
        """The message as chat templates take it: text content, developer as system."""
        text = self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        message.update((k, getattr(self, k)) for k in ("tool_call_id", "name")
                       if getattr(self, k) is not None)
        if self.tool_calls is not None:
            message["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        return message


class FunctionDefinition(JsonObject):
    name: NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(JsonObject):
    type: Literal["function"]
    function: FunctionDefinition


class Conversation(JsonObject):
    """The fields of a chat that reach its template."""

    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description=(
        "the text ends inside the last message (a prefilled answer): no end of turn after it; "
        "needs add_generation_prompt false"))
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the chat template (e.g. enable_thinking)")

    @model_validator(mode="after")
    def _template_rules(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("'continue_final_message' continues the last message, so "
                             "'add_generation_prompt' must be false", "continue_final_message")
        taken = sorted(set(self.chat_template_kwargs or ())
                       & (TEMPLATE_VARIABLES | reserved_template_names()))
        if taken:
            raise FieldError(f"'chat_template_kwargs' may not set {taken} (the request's own "
                             "fields or the template's names)", "chat_template_kwargs")
        return self

    @classmethod
    def validated(cls, **fields: Any) -> "Conversation":
        """The conversation of these fields; FieldError naming the first bad one."""
        try:
            return cls.model_validate(fields)
        except ValidationError as e:
            raise first_error(e) from None

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]

    def render(self, tokenizer, messages: list[dict] | None = None,
               chat_template: str | None = None) -> str:
        """The conversation as prompt text (`messages`: the template messages, if changed);
        ChatTemplateError (param: the field) when the template refuses it."""
        tools = [t.model_dump(exclude_unset=True) for t in self.tools or ()]
        return tokenizer.apply_chat_template(
            self.template_messages() if messages is None else messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message, chat_template=chat_template,
            **(self.chat_template_kwargs or {}), **({"tools": tools} if tools else {}))
