"""A toy embedder and a chat it understands, for the semantic relevance tests."""

from __future__ import annotations

# A toy embedder with two topics: pets and weather. "feline" shares no word with "cat".
TOPICS = {"pets": ("cat", "feline", "miso", "kitten"), "weather": ("rain", "storm", "umbrella")}


def topic_embed(texts: list[str]) -> list[list[float]]:
    def vector(text: str) -> list[float]:
        low = text.lower()
        return [float(any(w in low for w in words)) for words in TOPICS.values()] + [0.1]

    return [vector(t) for t in texts]


def chat_about_a_cat() -> list[dict]:
    filler = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"The storm and the rain today, part {i}. " * 2}
        for i in range(30)
    ]
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "I adopted a cat named Miso last week."},
        {"role": "assistant", "content": "Congratulations on the new family member!"},
        *filler,
        {"role": "user", "content": "What was my feline called?"},
    ]
