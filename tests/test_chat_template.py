"""The server's chat template (`--chat-template`, vLLM's): a file or the template itself in place of
the tokenizer's, for every route that renders a chat; what a bad one does at load; a request's own
`chat_template`, refused as vLLM refuses it; and a classifier's pairs rendered by it (vLLM's score
templates)."""

from __future__ import annotations

import httpx
import pytest
from checkpoints import model_config
from server_harness import LiveServer, real_engine

from neuron.errors import ConfigError

TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Rivers?"}]
RENDERED = "[system] Be brief.\n[user] Rivers?\n[assistant] "


def test_a_template_file_or_text_replaces_the_tokenizers(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    for given in (str(path), TEMPLATE):
        tok = model_config(chat_template=given).tokenizer
        assert tok.apply_chat_template(CHAT) == RENDERED
        # a chat with tools renders through it too, not the tokenizer's own tool-use template
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        assert tok.apply_chat_template(CHAT, tools=tools) == RENDERED
    assert model_config().tokenizer.apply_chat_template(CHAT) != RENDERED


@pytest.mark.parametrize("given, refused", [
    ("/no/such/template.jinja", "no such file, and not a Jinja template"),
    ("{% for m in messages %}{{ m.content }}", "does not compile"),
])
def test_a_template_that_cannot_be_used_stops_the_load(given, refused):
    with pytest.raises(ConfigError, match=refused):
        model_config(chat_template=given)


@pytest.fixture(scope="module")
def templated_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    engine = real_engine(None, tp=1, name="templated", chat_template=str(path))
    with LiveServer(engine) as server:
        yield server.wait_ready()


def test_the_server_renders_every_chat_with_it(templated_server):
    url = templated_server.url
    assert httpx.post(f"{url}/apply-template", json={"messages": CHAT}).json()["prompt"] == RENDERED
    counted = httpx.post(f"{url}/tokenize", json={"model": "templated", "messages": CHAT}).json()
    plain = httpx.post(f"{url}/tokenize", json={"model": "templated", "prompt": RENDERED,
                                                "add_special_tokens": False}).json()
    assert counted["tokens"] == plain["tokens"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "templated", "messages": CHAT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(plain["tokens"])


def test_a_requests_own_template_is_refused(templated_server):
    r = httpx.post(f"{templated_server.url}/v1/chat/completions",
                   json={"model": "templated", "messages": CHAT, "max_tokens": 2, "chat_template": TEMPLATE})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("chat_template", "unsupported_parameter")
    assert "--chat-template" in error["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
    ("/tokenize", {"messages": CHAT}),
])
def test_chat_template_kwargs_cannot_carry_a_template(templated_server, path, body):
    """A template passed as a template argument would be the request's own template by another
    door: refused like the field."""
    r = httpx.post(f"{templated_server.url}{path}", json={"model": "templated", **body,
                                                          "chat_template_kwargs": {"chat_template": "{{ 1 }}"}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs" and "chat_template" in r.json()["error"]["message"]
