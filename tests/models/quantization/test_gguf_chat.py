# SPDX-License-Identifier: Apache-2.0
"""Chat, reasoning and tool calls from a GLM-5 GGUF as from its checkpoint, on CPU.

The tiny GLM-5 of `glm5_chat_gguf` has a tokenizer with GLM-5's added tokens and a
GLM-5-shaped chat template, and a generation_config.json naming GLM-5's end-of-turn
tokens (eos_token_id [<|endoftext|>, <|user|>, <|observation|>]) and sampling
defaults; llama.cpp's converter turns it into the GGUF. Against that checkpoint,
through vLLM's own entry points:

- the generation config vLLM builds for `vllm serve file.gguf` (stop tokens, default
  sampling parameters), with split files and with `--generation-config`;
- the tokenizer: special tokens and ids, added tokens, encode/decode, model_max_length,
  the chat template's ids for system/user/assistant/tool turns, with and without
  thinking;
- the output of GLM-5's parsers (its vLLM recipe: `--reasoning-parser glm45
  --tool-call-parser glm47`) on fixed texts, whole and token by token.
"""

import json

import pytest

from tests.models.quantization import gguf_reference as gr
from tests.models.quantization.test_gguf_engine_args import model_config
from vllm_gguf_plugin import gguf_model as gg

# what vLLM reads of a generation config: eos_token_id for the stop tokens
# (SamplingParams.update_from_generation_config), these for the default sampling
# parameters (ModelConfig.get_diff_sampling_param)
SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p",
                   "max_new_tokens")


def gguf_path(files, kind):
    """The reference a user names: the file, or the last part of a split set."""
    if kind == "split":
        return str(gg.split_files(files["split"])[-1])
    return str(files[kind])


def stop_tokens(config, tokenizer):
    """The stop tokens vLLM gives a request (v1 InputProcessor: the tokenizer's eos,
    then the generation config's eos_token_id)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8)
    params.update_from_generation_config(config.try_get_generation_config(),
                                         tokenizer.eos_token_id)
    return params.eos_token_id, set(params.stop_token_ids), set(params.all_stop_token_ids)


@pytest.fixture(scope="module")
def checkpoint(glm5_chat_gguf):
    from transformers import AutoTokenizer

    _, model, _ = glm5_chat_gguf
    return model, AutoTokenizer.from_pretrained(model)


@pytest.mark.parametrize("kind", ["bf16", "split"])
def test_generation_config_from_gguf(glm5_chat_gguf, checkpoint, kind):
    from vllm.tokenizers import get_tokenizer

    _, model, files = glm5_chat_gguf
    ref_config = model_config(str(model))
    config = model_config(gguf_path(files, kind))
    assert config.hf_config_path == str(files["split" if kind == "split" else kind])
    ref, got = ref_config.try_get_generation_config(), config.try_get_generation_config()
    for f in ("eos_token_id", "pad_token_id", *SAMPLING_FIELDS):
        assert got.get(f) == ref.get(f), f
    assert len(ref["eos_token_id"]) == 3  # <|endoftext|>, <|user|>, <|observation|>
    # vLLM's default sampling parameters, all five the checkpoint sets
    defaults = config.get_diff_sampling_param()
    assert defaults == ref_config.get_diff_sampling_param()
    assert set(defaults) == set(gr.GLM5_SAMPLING)
    # the stop tokens of a request: eos, and GLM-5's end-of-turn tokens
    tokenizer = get_tokenizer(config.tokenizer, tokenizer_mode=config.tokenizer_mode)
    assert stop_tokens(config, tokenizer) == stop_tokens(ref_config, checkpoint[1])
    eos, stops, _ = stop_tokens(config, tokenizer)
    assert (tokenizer.convert_ids_to_tokens(eos), set(tokenizer.convert_ids_to_tokens(
        list(stops)))) == ("<|endoftext|>", {"<|user|>", "<|observation|>"})


def test_generation_config_option_wins(glm5_chat_gguf, tmp_path):
    """--generation-config vllm (vLLM's sampling defaults) and a folder of its own
    take precedence over the GGUF's, as over a checkpoint's."""
    _, model, files = glm5_chat_gguf
    for source in (model, files["bf16"]):
        config = model_config(str(source), generation_config="vllm")
        assert config.get_diff_sampling_param() == {}
    own = tmp_path / "gen"
    own.mkdir()
    (own / "generation_config.json").write_text(json.dumps({"temperature": 0.3,
                                                            "eos_token_id": 5}))
    got = [model_config(str(source), generation_config=str(own))
           for source in (model, files["bf16"])]
    assert got[1].get_diff_sampling_param() == got[0].get_diff_sampling_param() == {
        "temperature": 0.3}
    assert got[1].try_get_generation_config()["eos_token_id"] == 5


def test_generation_config_errors_name_key(glm5_chat_gguf, tmp_path):
    llama_cpp, _, files = glm5_chat_gguf
    gguf = gr.gguf_module(llama_cpp)
    bad = gr.rewrite(gguf, files["bf16"], tmp_path / "bad-eot.gguf",
                     metadata={"tokenizer.ggml.eot_token_id": 10 ** 6})
    with pytest.raises(gg.GGUFError, match=r"bad-eot\.gguf.*'tokenizer\.ggml\.eot_token_id'"):
        gg.generation_config_from_gguf(bad)
    bad = gr.rewrite(gguf, files["bf16"], tmp_path / "bad-temp.gguf",
                     drop_keys=("general.sampling.temp",),
                     add={"general.sampling.temp": ("hot", gguf.GGUFValueType.STRING)})
    with pytest.raises(gg.GGUFError, match=r"bad-temp\.gguf.*'general\.sampling\.temp'"):
        gg.generation_config_from_gguf(bad)
    bad = gr.rewrite(gguf, files["bf16"], tmp_path / "bad-bos.gguf",
                     metadata={"tokenizer.ggml.bos_token_id": 10 ** 6})
    with pytest.raises(gg.GGUFError, match=r"bad-bos\.gguf.*'tokenizer\.ggml\.bos_token_id'"):
        gg.tokenizer_from_gguf(bad)


def gguf_tokenizers(files):
    """The GGUF's tokenizer as the overlay builds it and as vLLM serves it (the
    tokenizer mode the plugin selects for it)."""
    from vllm.tokenizers import get_tokenizer

    return {"tokenizer_from_gguf": gg.tokenizer_from_gguf(files["bf16"]),
            "vllm": get_tokenizer(str(files["bf16"]), tokenizer_mode=gg.TOKENIZER_MODE),
            "vllm split": get_tokenizer(gguf_path(files, "split"),
                                        tokenizer_mode=gg.TOKENIZER_MODE)}


def added_tokens(tokenizer):
    return {i: (t.content, t.special, t.normalized, t.lstrip, t.rstrip, t.single_word)
            for i, t in tokenizer.added_tokens_decoder.items()}


TEXTS = [
    "GLM-5 sparse attention test sentence number 12345: the quick brown fox",
    "[gMASK]<sop><|system|>be brief<|user|>hi<|assistant|><think>Looking it up</think>"
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
    "<|observation|><tool_response>sunny</tool_response><|assistant|></think>ok<|endoftext|>",
    "你好, мир! It's  <|begin_of_box|>1<|end_of_box|> /nothink\n\n",
    "",
]


def test_tokenizer_equals_checkpoint(glm5_chat_gguf, checkpoint):
    llama_cpp, _, files = glm5_chat_gguf
    _, ref = checkpoint
    reader = gr.gguf_module(llama_cpp).GGUFReader(files["bf16"])
    bos_id = reader.fields["tokenizer.ggml.bos_token_id"].contents()
    for name, tok in gguf_tokenizers(files).items():
        assert tok.get_vocab() == ref.get_vocab() and len(tok) == len(ref), name
        # GLM-5's added tokens, never split, special or not as in the checkpoint
        assert added_tokens(tok) == added_tokens(ref), name
        assert len(added_tokens(ref)) == len(gr.GLM5_ADDED_TOKENS)
        assert (dict(zip(tok.all_special_tokens, tok.all_special_ids))
                == dict(zip(ref.all_special_tokens, ref.all_special_ids))), name
        for attr in ("eos_token", "eos_token_id", "pad_token", "pad_token_id", "unk_token",
                     "model_max_length", "chat_template", "clean_up_tokenization_spaces"):
            assert getattr(tok, attr) == getattr(ref, attr), (name, attr)
        # The checkpoint names no BOS (as GLM-5's); llama.cpp's converter then names
        # [gMASK] (_set_vocab_glm), the token GLM's chat template starts with, and the
        # tokenizer takes the file's. Nothing serving reads changes: it is among the
        # special tokens either way (above) and the template does not use bos_token
        # (test_chat_template_ids).
        assert ref.bos_token is None
        assert tok.bos_token_id == bos_id and tok.bos_token == "[gMASK]", name
        for text in TEXTS:
            ids = ref.encode(text)
            assert tok.encode(text) == ids, (name, text)
            for skip in (False, True):
                assert (tok.decode(ids, skip_special_tokens=skip)
                        == ref.decode(ids, skip_special_tokens=skip)), (name, text, skip)
        for t in gr.GLM5_ADDED_TOKENS:
            assert tok.encode(t) == ref.encode(t) == [ref.convert_tokens_to_ids(t)], (name, t)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "date": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = {"type": "function", "function": {"name": "get_weather",
                                         "arguments": {"city": "Paris", "date": "today"}}}
CONVERSATIONS = {
    "system, user": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": "hi"}],
    "two turns": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "Hello there!",
                   "reasoning_content": "A greeting."},
                  {"role": "user", "content": "the weather?"}],
    "tools": [{"role": "user", "content": "the weather in Paris?"},
              {"role": "assistant", "content": "", "reasoning_content": "Looking it up",
               "tool_calls": [CALL]},
              {"role": "tool", "content": "sunny"},
              {"role": "tool", "content": "21 degrees"}],
}


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_chat_template_ids(glm5_chat_gguf, checkpoint, conversation):
    _, _, files = glm5_chat_gguf
    _, ref = checkpoint
    messages = CONVERSATIONS[conversation]
    tools = TOOLS if conversation == "tools" else None
    for name, tok in gguf_tokenizers(files).items():
        for thinking in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
            for prompt in (True, False):
                kw = dict(tools=tools, add_generation_prompt=prompt, tokenize=True,
                          return_dict=False, **thinking)
                ids = ref.apply_chat_template(messages, **kw)
                assert tok.apply_chat_template(messages, **kw) == ids, (name, thinking, prompt)
                # the prompt is GLM-5's: the turns' special tokens, single tokens
                assert ids[:2] == ref.convert_tokens_to_ids(["[gMASK]", "<sop>"])


# model outputs as GLM-5 writes them (the text vLLM detokenizes with
# skip_special_tokens=False, as the parsers ask): the prompt's generation prompt
# opens <think> unless enable_thinking is false
OUTPUTS = {
    "reasoning": ({}, "Looking it up</think>The weather in Paris is sunny."),
    "reasoning, tool call": (
        {}, "Looking it up</think><tool_call>get_weather<arg_key>city</arg_key>"
            "<arg_value>Paris</arg_value></tool_call>"),
    "tool calls": (
        {"enable_thinking": False},
        "<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>date</arg_key><arg_value>today</arg_value></tool_call>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>"),
    "content, stray special token": (
        {"enable_thinking": False}, "Hello there!<|begin_of_box|> 21<|end_of_box|> degrees"),
}


def parse(tokenizer, kwargs, text):
    """GLM-5's recipe's parsers (ParserManager, as vLLM's chat completions build
    them) on `text`: whole, and streamed a token at a time."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    parser_cls = ParserManager.get_parser(tool_parser_name="glm47",
                                          reasoning_parser_name="glm45",
                                          enable_auto_tools=True)
    messages = [{"role": "user", "content": "the weather in Paris?"}]
    request = ChatCompletionRequest(model="m", messages=messages, tools=TOOLS,
                                    chat_template_kwargs=kwargs)
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                           tokenize=True, return_dict=False, **kwargs)
    ids = tokenizer.encode(text)

    def new():
        parser = parser_cls(tokenizer, request.tools, chat_template_kwargs=kwargs,
                            model_config=None)
        parser.adjust_request(request)
        return parser

    reasoning, content, calls = new().parse(text, request, enable_auto_tools=True,
                                            model_output_token_ids=ids)
    whole = (reasoning, content, [(c.name, json.loads(c.arguments)) for c in calls or []])
    parser, streamed, names, args = new(), {"reasoning": "", "content": ""}, {}, {}
    for i in range(len(ids)):
        delta_text = (tokenizer.decode(ids[:i + 1], skip_special_tokens=False)
                      [len(tokenizer.decode(ids[:i], skip_special_tokens=False)):])
        delta = parser.parse_delta(delta_text, ids[i:i + 1], request, prompt_token_ids=prompt,
                                   finished=i == len(ids) - 1)
        if delta is None:
            continue
        streamed["reasoning"] += delta.reasoning or ""
        streamed["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            if call.function and call.function.name:
                names[call.index] = names.get(call.index, "") + call.function.name
            if call.function and call.function.arguments:
                args[call.index] = args.get(call.index, "") + call.function.arguments
    streamed["tool_calls"] = [(names[i], json.loads(args.get(i) or "{}")) for i in sorted(names)]
    return whole, streamed


@pytest.mark.parametrize("output", list(OUTPUTS))
def test_parsers_on_gguf_tokenizer(glm5_chat_gguf, checkpoint, output):
    _, _, files = glm5_chat_gguf
    _, ref = checkpoint
    kwargs, text = OUTPUTS[output]
    expected = parse(ref, kwargs, text)
    (reasoning, content, calls), streamed = expected
    # the outputs are parsed (with the checkpoint's tokenizer): reasoning and tool
    # calls in their fields; streamed, the tokenizer's other special tokens are
    # dropped from the content (vLLM's parser engine drops all_special_tokens)
    assert bool(reasoning) == bool(streamed["reasoning"]) == ("</think>" in text)
    assert len(calls) == len(streamed["tool_calls"]) == text.count("<tool_call>")
    assert "<|" not in streamed["content"]
    for name, tok in gguf_tokenizers(files).items():
        assert parse(tok, kwargs, text) == expected, name
