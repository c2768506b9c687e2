"""The chat template of `/v1/chat/completions`: the checkpoint's own (tokenizer_config.json "chat_template", as
transformers renders it) or the file server.chat_template names, rendered with Jinja2 in a sandbox (a template is
code from a checkpoint download: it may not reach Python attributes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

from dsaflow.errors import ServeError

from .protocol import ApiError


class ChatTemplate:
    """source: the template text; specials: the tokenizer_config.json tokens a template may use (bos_token, ...)."""

    def __init__(self, source: str, specials: Optional[dict] = None, where: str = ""):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_in_template
        try:
            self.template = env.from_string(source)
        except TemplateError as exc:
            raise ServeError(f"{where}: the chat template does not parse ({exc}). Fix: repair it.") from None
        self.specials = specials or {}

    def render(self, messages: List[dict]) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.specials)
        except TemplateError as exc:  # the template's own raise_exception, or a message it cannot take
            raise ApiError(400, f"the chat template refused these messages: {exc}", "messages") from None


def _raise_in_template(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


def _token_text(v) -> Optional[str]:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    return v.get("content") if isinstance(v, dict) else v if isinstance(v, str) else None


def load_chat_template(template_file: Optional[str], hf_folder: Optional[Path]) -> Optional[ChatTemplate]:
    """server.chat_template (a file), else the checkpoint folder's tokenizer_config.json "chat_template"; None when
    neither has one. Raises ServeError for a file that is missing or does not parse."""
    config = {}
    cfg_file = Path(hf_folder) / "tokenizer_config.json" if hf_folder is not None else None
    if cfg_file is not None and cfg_file.is_file():
        try:
            config = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as exc:
            raise ServeError(f"{cfg_file} is not JSON ({exc}). Fix: restore it.") from None
    specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    specials = {k: v for k, v in specials.items() if v is not None}
    if template_file:
        try:
            return ChatTemplate(Path(template_file).read_text(), specials, f"server.chat_template={template_file}")
        except OSError as exc:
            raise ServeError(
                f"server.chat_template={template_file} cannot be read ({exc}). Fix: a Jinja file."
            ) from None
    source = config.get("chat_template")
    if isinstance(source, list):  # several named templates: the default one
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    return ChatTemplate(source, specials, str(cfg_file)) if isinstance(source, str) else None


def encode_rendered(tokenizer, text: str):
    """A rendered conversation -> token ids, without the special tokens the tokenizer's post-processor adds: the
    template writes its own (transformers' apply_chat_template does the same)."""
    inner = getattr(tokenizer, "tok", None)  # dsaflow.data.hf_tokenizer.HFTokenizer's `tokenizers` object
    return inner.encode(text, add_special_tokens=False).ids if inner is not None else tokenizer.encode(text)
