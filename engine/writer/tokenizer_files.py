"""tokenizer.json, tokenizer_config.json and chat_template.jinja for a writer-made model.

A byte-level BPE (ByteLevel pre-tokenizer and decoder, all 256 byte symbols, so any text encodes)
with merges learned by tokenizers' BpeTrainer on a small built-in English text, so ordinary words
take few tokens. Special tokens as in the gpt-oss fixture: <|endoftext|> (0, eos and pad),
<|start|> (1, bos), <|end|> (2).
"""

from __future__ import annotations

import json

SPECIAL_TOKENS = ["<|endoftext|>", "<|start|>", "<|end|>"]
EOS_ID, BOS_ID, PAD_ID = 0, 1, 0
MAX_TRAINED_VOCAB = 4096   # the corpus runs out of useful merges long before this

CHAT_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")

CORPUS = """\
Hello world! This is a small model written by a program, and its weights are random numbers.
The text it writes has no meaning, but the words you type are split into a few tokens each.
Hello, how are you today? I am fine, thank you. What would you like to know about the world?
The quick brown fox jumps over the lazy dog. A good day starts with a cup of coffee and a walk.
When you ask a question, the model reads your words and answers with one token at a time.
Each layer of the model has a router that sends every token to a few of its many experts.
The experts are small networks, and only the ones the router picks are computed for a token.
People use language models to write letters, answer questions, summarise long documents,
translate between languages, and help with code. They run on computers with a lot of memory.
The house was quiet in the morning. She opened the window, and the cold air came into the room.
He said that they would meet again in the evening, after the work of the day was done.
We have been thinking about the time it takes to read the weights from memory for each token.
There are many things that can make a program slow: waiting for the disk, copying data,
and doing more work than is needed. It is important to measure before you change anything.
Please tell me a story about a cat who lived in a small town near the sea.
Once upon a time there was a little cat. Every day she walked down to the water and watched
the boats come back with fish. The people of the town knew her well and gave her food.
What is the weather like? It is sunny and warm, with a light wind from the west.
The number of people who live in the city has grown every year for the last twenty years.
Thank you for your help. You are welcome. Good night, and see you tomorrow.
The system, the user and the assistant each take turns in a conversation.
Water, food, time, money, work, school, family, friend, government, company, problem, question.
First, second, third, one, two, three, four, five, six, seven, eight, nine, ten, hundred.
Hello world. Hello there. Hello again, world. Hello world!
hello world, said the little program. hello, hello, is anyone there? say hello to the world.
"""


def build_tokenizer(vocab_size: int):
    """Train the byte-level BPE (deterministic for a given vocab_size); at most vocab_size ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, MAX_TRAINED_VOCAB), special_tokens=SPECIAL_TOKENS,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2)
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    if tok.get_vocab_size() > vocab_size:   # cannot happen with vocab_size >= 259; guard the contract
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} ids, more than vocab_size {vocab_size}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def tokenizer_config(context_length: int) -> dict:
    return {
        "backend": "tokenizers",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "is_local": True,
        "local_files_only": True,
        "model_max_length": context_length,
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "tokenizer_class": "TokenizersBackend",
    }


def tokenizer_files(vocab_size: int, context_length: int) -> tuple[dict[str, str], int]:
    """The three files' texts by name, and the tokenizer's size."""
    tok = build_tokenizer(vocab_size)
    return {"tokenizer.json": tok.to_str(pretty=True),
            "tokenizer_config.json": json.dumps(tokenizer_config(context_length), indent=2) + "\n",
            "chat_template.jinja": CHAT_TEMPLATE}, tok.get_vocab_size()
