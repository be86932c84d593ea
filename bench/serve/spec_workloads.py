"""The workloads of bench_spec.py made of chat requests: the input-grounded one, whose
answers copy their input, and open questions (`chat`), whose answers do not.

Deterministic synthetic documents (a fixed seed, fixed word lists, nothing downloaded) of
300-1,500 tokens: invoice records (an id, a person, a date, a city, an item, an amount) set
in prose assembled from a fixed vocabulary. Each request asks for one of three answers that
repeat the document, where prompt lookup can guess the next tokens:

  - extract: every invoice as JSON with fields copied verbatim;
  - quote: the sentence that answers a question about one invoice, word for word;
  - rewrite: the passage again with small edits (dates reformatted, one city renamed).

The open questions are the control where little repeats: short prompts (a template and a
topic from fixed lists) asking for an explanation, advice or a story, whose greedy answers
quote nothing and, unlike W48's random-token prompts, do not fall into loops a proposer
finds.

Prompts are rendered by the model's own chat template (transformers' apply_chat_template on
the wheel's GGUF) into token ids, which both engines take as they are. A system message
names the round, and bench_spec.py draws new documents and questions for every round (and
for every concurrency): a request seen before would find its answer in the suffix
proposer's history of earlier answers, and speculation would look better than it is.
"""

from __future__ import annotations

import random

FIRST = ("Maria", "James", "Aiko", "Olumide", "Sofia", "Lars", "Priya", "Mateo", "Hannah", "Chen", "Fatima", "Jonas",
         "Elena", "Kwame", "Ingrid", "Rafael", "Yara", "Tomasz", "Leila", "Arjun")
LAST = ("Keller", "Okafor", "Tanaka", "Lindqvist", "Moreau", "Silva", "Novak", "Haddad", "Brennan", "Castillo",
        "Iyer", "Schmidt", "Duarte", "Mensah", "Kowalski", "Larsen", "Rossi", "Nakamura", "Fischer", "Osei")
CITIES = ("Lisbon", "Rotterdam", "Osaka", "Nairobi", "Montreal", "Krakow", "Valencia", "Gothenburg", "Porto Alegre",
          "Leeds", "Pune", "Tallinn", "Cork", "Brno", "Adelaide", "Lyon")
ITEMS = ("steel brackets", "printer cartridges", "oak planks", "LED panels", "copper wire", "ceramic tiles",
         "safety gloves", "solar inverters", "hydraulic hoses", "office chairs", "water filters", "cargo straps")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
ADJECTIVES = ("quarterly", "regional", "delayed", "revised", "overdue", "seasonal", "annual", "urgent", "partial",
              "standard", "disputed", "confirmed")
NOUNS = ("shipment", "audit", "order", "contract", "delivery", "review", "payment", "warehouse", "schedule", "budget",
         "supplier", "report")
VERBS = ("was approved by", "was checked against", "was moved ahead of", "was filed with", "was matched to",
         "was held back for", "was sent to", "was reconciled with")

SYSTEM = "Round {round}. You are a careful assistant. Copy names, numbers and dates exactly as written."
ASKS = {
    "extract": ("Extract every invoice in the document below as a JSON list of objects with the fields "
                "\"id\", \"name\", \"date\", \"city\", \"item\" and \"amount\". Copy each value exactly as written."),
    "quote": "Quote, word for word, the sentence of the document below that answers this question: {question} "
             "Answer with the quoted sentence only.",
    "rewrite": "Rewrite the document below exactly as it is, but change the city {old} to {new} everywhere and "
               "write every amount without the word EUR.",
}
KINDS = tuple(ASKS)

SYSTEM_CHAT = "Round {round}. You are a helpful assistant."
QUESTIONS = ("Explain to a curious teenager how {topic} works.", "Give three practical tips about {topic}.",
             "Write a short story in which {topic} plays a part.", "What are the main arguments for and against {topic}?",
             "Describe the history of {topic} in a few paragraphs.", "Write a friendly email inviting a colleague to "
             "a talk about {topic}.")
TOPICS = ("bicycle gears", "composting", "volcanoes", "public libraries", "jazz improvisation", "tide pools",
          "solar panels", "beekeeping", "the printing press", "sourdough bread", "night trains", "chess openings",
          "glaciers", "urban gardens", "lighthouses", "vaccines", "origami", "wind turbines", "coral reefs",
          "typewriters", "hot air balloons", "mushroom foraging", "rainwater harvesting", "museum curation")


def invoice(rng: random.Random) -> dict:
    return {"id": f"INV-{rng.randint(10000, 99999)}", "name": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
            "date": f"{rng.randint(1, 28)} {rng.choice(MONTHS)} {rng.randint(2019, 2025)}",
            "city": rng.choice(CITIES), "item": rng.choice(ITEMS), "quantity": rng.randint(2, 900),
            "amount": f"{rng.randint(120, 98000):,}.{rng.randint(0, 99):02d} EUR"}


def invoice_sentence(record: dict) -> str:
    return (f"Invoice {record['id']} was issued on {record['date']} by {record['name']} of {record['city']} "
            f"for {record['quantity']} units of {record['item']}, a total of {record['amount']}.")


def filler_sentence(rng: random.Random) -> str:
    return (f"The {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} in {rng.choice(CITIES)} {rng.choice(VERBS)} "
            f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} before {rng.randint(1, 28)} {rng.choice(MONTHS)}.")


def document(rng: random.Random, tokens: int, count) -> tuple[str, list[dict]]:
    """Paragraphs of invoice and filler sentences, grown until `count(text)` reaches `tokens`."""
    records: list[dict] = []
    paragraphs: list[list[str]] = [[]]
    size = 0
    while size < tokens:
        if rng.random() < 0.5:
            records.append(invoice(rng))
            sentence = invoice_sentence(records[-1])
        else:
            sentence = filler_sentence(rng)
        paragraphs[-1].append(sentence)
        size += count(sentence) + 1
        if len(paragraphs[-1]) >= rng.randint(3, 6):
            paragraphs.append([])
    if not records:
        records.append(invoice(rng))
        paragraphs[-1].append(invoice_sentence(records[-1]))
    return "\n\n".join(" ".join(p) for p in paragraphs if p), records


def grounded(count_tokens, num_requests: int, seed: int = 0) -> list[tuple[list[dict], str]]:
    """(messages without the round's system message, kind) for `num_requests` requests; the
    kinds take turns. `count_tokens(text)` sizes the documents (300-1,500 tokens)."""
    rng = random.Random(seed)
    requests = []
    for index in range(num_requests):
        kind = KINDS[index % len(KINDS)]
        text, records = document(rng, rng.randint(300, 1500), count_tokens)
        if kind == "quote":
            record = rng.choice(records)
            ask = ASKS[kind].format(question=f"What did {record['name']} of {record['city']} buy on {record['date']}?")
        elif kind == "rewrite":
            old = rng.choice(records)["city"]
            ask = ASKS[kind].format(old=old, new=rng.choice([c for c in CITIES if c != old]))
        else:
            ask = ASKS[kind]
        requests.append(([{"role": "user", "content": f"{ask}\n\n{text}"}], kind))
    return requests


def chat(num_requests: int, draw: int = 0) -> list[tuple[list[dict], str]]:
    """(messages without the round's system message, "chat") for `num_requests` open
    questions: the `draw`-th run of a fixed shuffle of every question and topic pair, so
    neither one draw nor the next repeat a pair while the pairs last."""
    pairs = [(question, topic) for question in QUESTIONS for topic in TOPICS]
    random.Random(0).shuffle(pairs)
    start = draw * num_requests
    return [([{"role": "user", "content": pairs[(start + index) % len(pairs)][0].format(
        topic=pairs[(start + index) % len(pairs)][1])}], "chat") for index in range(num_requests)]


def for_round(requests, round_index: int) -> list[list[dict]]:
    """Each request's messages with the system message naming the round."""
    return [[{"role": "system", "content": (SYSTEM_CHAT if kind == "chat" else SYSTEM).format(round=round_index)},
             *messages] for messages, kind in requests]
