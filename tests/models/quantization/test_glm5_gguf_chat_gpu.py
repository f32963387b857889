# SPDX-License-Identifier: Apache-2.0
"""GPU: `vllm serve file.gguf` as GLM-5's vLLM recipe runs it (`--reasoning-parser
glm45 --tool-call-parser glm47 --enable-auto-tool-choice`), with nothing but the GGUF
of the tiny GLM-5 of `glm5_chat_gguf` (GLM-5's added tokens, chat template and
generation config, test_gguf_chat.py).

So that replies are known, the tiny model is scripted: its attention and MLP output
projections are zero, so the logits depend on the last token alone, and its lm_head
maps each token of a script to the next (a bigram model), each script token having
one successor. With greedy sampling:

- a chat reply continued from "Hello" is " there!" then <|user|>: the reply stops
  there (an end-of-turn token of the generation config, not the eos), without it;
- after the generation prompt's <think> the model reasons "Looking it up", closes
  </think> and calls get_weather(city=Paris) ending with <|observation|>: the
  reasoning and the tool call come back in their fields (whole and streamed); with
  enable_thinking false the prompt ends with </think> and the reply is the call.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.models.quantization import gguf_reference as gr
from tests.plugins.vllm_report_capability import vllm_report_capability as hook

pytestmark = pytest.mark.gpu

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "the weather in Paris?"}]
GREETING = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
SERVE = ["--served-model-name", "m", "--max-model-len", "2048", "--enforce-eager", "--dtype", "float16",
         "--attention-backend", "TRITON_MLA_SPARSE", "--block-size", "64",
         "--kv-cache-memory-bytes", str(1 << 30), "--max-num-seqs", "4",
         "--reasoning-parser", "glm45", "--tool-call-parser", "glm47",
         "--enable-auto-tool-choice"]


def scripts(tokenizer) -> dict[str, list[int]]:
    """Each script: the prompt's last token, then the tokens the model writes."""
    def ids(text):
        return tokenizer.encode(text, add_special_tokens=False)

    def one(token):
        return [tokenizer.convert_tokens_to_ids(token)]

    call = (one("<tool_call>") + ids("get_weather") + one("<arg_key>") + ids("city")
            + one("</arg_key>") + one("<arg_value>") + ids("Paris") + one("</arg_value>")
            + one("</tool_call>") + one("<|observation|>"))
    greeting = tokenizer.apply_chat_template(
        GREETING, add_generation_prompt=False, continue_final_message=True, tokenize=True,
        return_dict=False, enable_thinking=False)
    return {"reasoning": one("<think>") + ids("Looking it up") + one("</think>") + call,
            "greeting": greeting[-1:] + ids(" there!") + one("<|user|>")}


def scripted_checkpoint(src: Path, out: Path, tokenizer) -> Path:
    """A copy of the checkpoint `src` whose greedy replies follow `scripts`."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    for name, t in tensors.items():
        if re.search(r"(o_proj|down_proj)\.weight$", name):
            tensors[name] = torch.zeros_like(t)
    embed = tensors["model.embed_tokens.weight"].float()
    head = torch.zeros(tensors["lm_head.weight"].shape)
    successors: dict[int, int] = {}
    for script in scripts(tokenizer).values():
        for a, b in zip(script, script[1:]):
            assert successors.setdefault(a, b) == b, f"token {a} has two successors"
            # the final norm makes the residual embed[a] / rms: logit ~ sqrt(hidden)
            head[b] += embed[a] / embed[a].norm()
    tensors["lm_head.weight"] = head.to(torch.bfloat16)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def vllm_serve(model: Path, log: Path, timeout: float = 600):
    import requests

    port = free_port()
    # the portable indexer where the test plugin is installed (the replies do not depend
    # on the indexer: the attention's output projections are zero)
    env = {**os.environ, **hook.indexer_env("triton")}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
                                 str(model), "--port", str(port), *SERVE],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, log.read_text()[-5000:]
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-5000:]
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def chat(url, messages, **kw):
    import requests

    body = {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 32, **kw}
    res = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert res.status_code == 200, res.text
    return res.json()["choices"][0]


def chat_stream(url, messages, **kw):
    """A streamed chat completion, its deltas put together."""
    import requests

    body = {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 32,
            "stream": True, **kw}
    out = {"reasoning": "", "content": "", "names": {}, "arguments": {}}
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True,
                       timeout=120) as res:
        assert res.status_code == 200, res.text
        for line in res.iter_lines(decode_unicode=True):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                out["reasoning"] += delta.get("reasoning") or delta.get("reasoning_content") or ""
                out["content"] += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    f = call.get("function") or {}
                    for key, into in (("name", "names"), ("arguments", "arguments")):
                        if f.get(key):
                            out[into][call["index"]] = out[into].get(call["index"], "") + f[key]
                if choice.get("finish_reason"):
                    out["finish_reason"] = choice["finish_reason"]
    return out


def reasoning_of(message):
    return message.get("reasoning") or message.get("reasoning_content")


def test_glm5_gguf_chat_reasoning_tools(glm5_chat_gguf, tmp_path):
    from transformers import AutoTokenizer

    llama_cpp, model, _ = glm5_chat_gguf
    tokenizer = AutoTokenizer.from_pretrained(model)
    scripted = scripted_checkpoint(model, tmp_path / "scripted", tokenizer)
    gguf = gr.convert(llama_cpp, scripted, tmp_path / "scripted-bf16.gguf", "bf16")
    script = scripts(tokenizer)
    user, observation = tokenizer.convert_tokens_to_ids(["<|user|>", "<|observation|>"])
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}

    with vllm_serve(gguf, tmp_path / "serve.log") as url:
        # the reply stops at <|user|> (generation config, not eos) and does not show it
        choice = chat(url, GREETING, add_generation_prompt=False, continue_final_message=True,
                      chat_template_kwargs={"enable_thinking": False})
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == user, choice
        assert (choice["message"]["content"].strip()
                == tokenizer.decode(script["greeting"][1:-1]).strip()), choice
        assert not reasoning_of(choice["message"])

        # reasoning, then a tool call: each in its field
        choice = chat(url, QUESTION, tools=TOOLS)
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["stop_reason"] == observation, choice
        assert reasoning_of(message) == "Looking it up", message
        assert not message.get("content"), message
        assert [{"name": c["function"]["name"], "arguments": json.loads(
            c["function"]["arguments"])} for c in message["tool_calls"]] == [call], message

        streamed = chat_stream(url, QUESTION, tools=TOOLS)
        assert streamed["reasoning"] == "Looking it up", streamed
        assert not streamed["content"].strip(), streamed
        assert [{"name": streamed["names"][i], "arguments": json.loads(streamed["arguments"][i])}
                for i in sorted(streamed["names"])] == [call], streamed
        assert streamed["finish_reason"] == "tool_calls", streamed

        # thinking off: the prompt closes </think>, the reply is the call alone
        choice = chat(url, QUESTION, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and not reasoning_of(message), choice
        assert [{"name": c["function"]["name"], "arguments": json.loads(
            c["function"]["arguments"])} for c in message["tool_calls"]] == [call], message
