"""SmolLM2's tokenizer and chat template, rebuilt from its GGUF metadata, against transformers
reading the same file (`gguf_file=`): same ids, same text, same rendered conversations."""

from __future__ import annotations

import pytest

from model_service.text.chat_template import ChatTemplate
from model_service.text.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from model_service.errors import ModelLoadError
from model_service.loading.embedded import embedded_model_path
from model_service.loading.gguf_config import config_from_gguf
from model_service.loading.gguf_file import GGUFFile
from model_service.loading.gguf_tokenizer import tokenizer_from_gguf

CORPUS = [
    "Hello, world! How are you today?",
    "The capital of France is Paris. It's 2,147 km² of... well, it isn't.",
    "Grüße aus München: naïve café, façade, Ærøskøbing, São Paulo, İstanbul.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "emoji 🙂👍🏽 and a family 👩‍👩‍👧 and flags 🇫🇷🇯🇵",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "    leading spaces, trailing spaces    ",
    "runs\n\n\nof\n \n  newlines\t\ttabs  and   spaces",
    "numbers 1234567890 3.14159 1e-9 0xDEADBEEF",
    "<|im_start|>user\nspecial tokens in text<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b<repo_name>c<file_sep>",
    "mixed: Ελληνικά, русский, עברית, العربية, हिन्दी",
    "",
    " ",
    "\n",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "system", "content": "You are a pirate."},
     {"role": "user", "content": "Hello!"},
     {"role": "assistant", "content": "Arr, ahoy there, matey!"},
     {"role": "user", "content": "Where is the treasure? 🙂"}],
    [{"role": "user", "content": "Write a haiku about autumn."},
     {"role": "assistant", "content": "Leaves drift slowly down"},
     {"role": "user", "content": "Another, in 日本語."}],
]

# A second template, of the kind Llama 3 and many fine-tunes ship: bos_token, a
# raise_exception on alternation, loop controls, tojson, a namespace.
SECOND_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(turns=0) %}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = 'No system prompt.' %}{% endif %}"
    "[SYS]{{ system | tojson }}[/SYS]\n"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['content'] == 'skip me' %}{% continue %}{% endif %}"
    "{% set ns.turns = ns.turns + 1 %}"
    "  {{ message['role'] | upper }}: {{ message['content'] | trim }}{{ eos_token if message['role'] == 'assistant' }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT ({{ ns.turns }} turns"
    "{% if enable_thinking is defined and enable_thinking %}, thinking{% endif %}):{% endif %}"
)


@pytest.fixture(scope="module")
def smollm2():
    file = GGUFFile(embedded_model_path())
    config = config_from_gguf(file)
    tokenizer = tokenizer_from_gguf(file, config.eos_token_ids, config.bos_token_id)
    template = ChatTemplate(file.value("tokenizer.chat_template"), bos_token=tokenizer.token_text(config.bos_token_id),
                            eos_token=tokenizer.token_text(config.eos_token_ids[0]))
    return tokenizer, template


@pytest.fixture(scope="module")
def reference(smollm2_reference):
    return smollm2_reference[0]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encodes_as_transformers(smollm2, reference, add_special_tokens):
    tokenizer, _ = smollm2
    for text in CORPUS:
        assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == \
            reference.encode(text, add_special_tokens=add_special_tokens), text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decodes_as_transformers(smollm2, reference, skip_special_tokens):
    tokenizer, _ = smollm2
    for text in CORPUS:
        ids = reference.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == \
            reference.decode(ids, skip_special_tokens=skip_special_tokens), text
        if not skip_special_tokens:
            assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_and_ids(smollm2, reference):
    tokenizer, _ = smollm2
    assert tokenizer.vocab_size == len(reference) == 49152
    assert tokenizer.eos_token_ids == (reference.eos_token_id,) == (2,)
    assert tokenizer.bos_token_id == reference.bos_token_id == 1
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]  # whole, not cut into pieces


def test_streamed_text_never_splits_a_character(smollm2):
    tokenizer, _ = smollm2
    for text in CORPUS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detokenizer = IncrementalDetokenizer(tokenizer, [], stop=())
        pieces = [detokenizer.push([token]).text for token in ids]
        pieces.append(detokenizer.flush())
        assert all(REPLACEMENT_CHAR not in piece for piece in pieces), (text, pieces)
        assert "".join(pieces) == tokenizer.decode(ids), text


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=[f"conversation-{i}" for i in range(len(CONVERSATIONS))])
def test_smollm2_template_renders_as_transformers(smollm2, reference, messages):
    tokenizer, template = smollm2
    text = template.render(messages)
    assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    # Tokenized as transformers does: the template wrote every special token, none is added.
    expected_ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert tokenizer.encode(text, add_special_tokens=False) == list(expected_ids)


@pytest.mark.parametrize("messages", CONVERSATIONS + [[{"role": "user", "content": "skip me"}]],
                         ids=[f"conversation-{i}" for i in range(len(CONVERSATIONS) + 1)])
def test_second_template_renders_as_transformers(smollm2, reference, messages):
    tokenizer, _ = smollm2
    ours = ChatTemplate(SECOND_TEMPLATE, bos_token=reference.bos_token, eos_token=reference.eos_token)
    for kwargs in ({}, {"enable_thinking": True}):
        expected = reference.apply_chat_template(messages, chat_template=SECOND_TEMPLATE, tokenize=False,
                                                 add_generation_prompt=True, **kwargs)
        assert ours.render(messages, **kwargs) == expected
    assert ours.render(messages, enable_thinking=True).endswith(", thinking):")


def test_template_refusal_is_reported_with_its_message():
    from model_service.text.chat_template import ChatTemplateError

    template = ChatTemplate(SECOND_TEMPLATE, bos_token="<s>", eos_token="</s>")
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        template.render([{"role": "assistant", "content": "I speak first"}])


def test_template_sandbox_refuses_python_internals():
    from model_service.text.chat_template import ChatTemplateError

    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError, match="refused"):
        ChatTemplate(escape).render([{"role": "user", "content": "hi"}])


def test_template_that_does_not_compile_is_a_load_error():
    with pytest.raises(ModelLoadError, match="the chat template does not compile"):
        ChatTemplate("{% for message in messages %}never closed")
