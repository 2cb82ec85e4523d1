"""Generate the bundled pretraining corpus data/stories/ (deterministic; re-run to rebuild it byte for byte).

    python data/make_corpus.py            # data/stories/train.txt (~4 MB) and data/stories/valid.txt

Short children's stories from a small probabilistic grammar with state: a story keeps its hero's
name and pronoun, companion, place, lost object and weather from start to end, with dialogue,
a problem, a search and an ending. So there is structure to learn beyond word frequencies (agreement,
reuse of names introduced earlier, story order), yet a ~1M-parameter model learns it on a CPU in minutes.
One story per line. All text is generated here, so we are free to ship it (Apache-2.0, like the code).
"""

from __future__ import annotations

import random
from pathlib import Path

HERE = Path(__file__).resolve().parent / "stories"

HEROES = [
    ("Tom", "he", "his"),
    ("Mia", "she", "her"),
    ("Sam", "he", "his"),
    ("Lily", "she", "her"),
    ("Ben", "he", "his"),
    ("Zoe", "she", "her"),
    ("Max", "he", "his"),
    ("Anna", "she", "her"),
    ("Leo", "he", "his"),
    ("Ella", "she", "her"),
    ("Jack", "he", "his"),
    ("Rosa", "she", "her"),
    ("Noah", "he", "his"),
    ("Ivy", "she", "her"),
    ("Finn", "he", "his"),
    ("Nora", "she", "her"),
]
ANIMALS = ["cat", "dog", "bird", "fox", "rabbit", "duck", "frog", "mouse", "owl", "turtle", "pony", "bear"]
PET_NAMES = ["Pip", "Bobo", "Coco", "Dot", "Fluff", "Mango", "Pebble", "Sunny", "Tiko", "Button"]
PLACES = {
    "park": "under a big tree",
    "garden": "behind the flowers",
    "forest": "near an old log",
    "beach": "in the warm sand",
    "farm": "next to the red barn",
    "lake": "by the little boat",
    "hill": "behind a round rock",
    "town": "near the bakery",
}
THINGS = {
    "ball": "red",
    "kite": "blue",
    "book": "old",
    "hat": "yellow",
    "key": "shiny",
    "shoe": "green",
    "cup": "tiny",
    "drum": "loud",
    "scarf": "soft",
    "map": "folded",
}
WEATHER = [
    "The sun was bright",
    "It was a windy day",
    "Soft rain was falling",
    "The sky was grey",
    "It was a warm morning",
    "Snow covered the ground",
]
HELPERS = [
    ("an old man", "he"),
    ("a kind woman", "she"),
    ("a little girl", "she"),
    ("a tall boy", "he"),
    ("the baker", "he"),
    ("a farmer", "she"),
]
FEEL_BAD = ["sad", "worried", "upset", "scared"]
FEEL_GOOD = ["happy", "glad", "proud", "excited"]


def story(rng: random.Random) -> str:
    name, he, his = rng.choice(HEROES)
    He = he.capitalize()
    animal, pet = rng.choice(ANIMALS), rng.choice(PET_NAMES)
    place = rng.choice(list(PLACES))
    spot = PLACES[place]
    thing = rng.choice(list(THINGS))
    color = THINGS[thing]
    helper, hh = rng.choice(HELPERS)
    bad, good = rng.choice(FEEL_BAD), rng.choice(FEEL_GOOD)
    s = []
    s.append(
        rng.choice(
            [
                f"Once upon a time, there was a {rng.choice(['little', 'young', 'kind', 'curious'])} {'boy' if he == 'he' else 'girl'} named {name}.",
                f"{name} lived in a small house near the {place}.",
                f"There was once a child called {name} who loved the {place}.",
            ]
        )
    )
    a_animal = ("an " if animal[0] in "aeiou" else "a ") + animal
    s.append(
        rng.choice(
            [
                f"{name} had {a_animal} named {pet}.",
                f"{his.capitalize()} best friend was {a_animal} called {pet}.",
                f"Every day, {name} played with {his} {animal}, {pet}.",
            ]
        )
    )
    s.append(f"{rng.choice(WEATHER)}, so {name} and {pet} went to the {place}.")
    s.append(
        rng.choice(
            [
                f"{name} brought {his} {color} {thing}.",
                f"{He} took {his} {color} {thing} with {'him' if he == 'he' else 'her'}.",
            ]
        )
    )
    if rng.random() < 0.5:
        s.append(
            f"They played for a long time, and {pet} {rng.choice(['ran in circles', 'jumped up and down', 'made funny sounds', 'rolled on the ground'])}."
        )
    s.append(
        rng.choice(
            [
                f"But when it was time to go home, the {thing} was gone.",
                f"Suddenly, {name} saw that the {color} {thing} was missing.",
                f"Then a strong wind came, and the {thing} was lost.",
            ]
        )
    )
    s.append(f'{name} felt {bad}. "Where is my {thing}?" {he} asked.')
    s.append(
        rng.choice(
            [
                f"{pet} the {animal} wanted to help.",
                f'"Do not worry," said {helper}. "I will help you look."',
                f"{name} and {pet} looked everywhere in the {place}.",
            ]
        )
    )
    if rng.random() < 0.6:
        s.append(
            rng.choice(
                [
                    f"They looked {rng.choice(['behind a bush', 'under a bench', 'near the path', 'in the tall grass'])}, but the {thing} was not there.",
                    f"{He} called for the {thing}, but of course a {thing} cannot answer.",
                ]
            )
        )
    s.append(
        rng.choice(
            [
                f"At last, {pet} found the {thing} {spot}.",
                f"Then {name} saw something {color} {spot}. It was the {thing}!",
                f"Finally, {helper} found the {thing} {spot} and gave it back to {name}.",
            ]
        )
    )
    s.append(f'{name} was so {good}. "Thank you, {pet}!" {he} said, and {he} hugged the {animal}.')
    s.append(
        rng.choice(
            [
                f"From that day on, {name} always kept {his} {thing} close.",
                f"They walked home together, and {name} smiled all the way.",
                f"That night, {name} and {pet} slept well, dreaming of the {place}.",
                f"{name} learned that a good friend always helps.",
            ]
        )
    )
    return " ".join(s)


def main(train_bytes: int = 4_000_000, valid_stories: int = 400) -> None:
    rng = random.Random(2024)
    HERE.mkdir(parents=True, exist_ok=True)
    valid = [story(rng) for _ in range(valid_stories)]
    train, size = [], 0
    while size < train_bytes:
        train.append(story(rng))
        size += len(train[-1]) + 1
    (HERE / "train.txt").write_text("\n".join(train) + "\n")
    (HERE / "valid.txt").write_text("\n".join(valid) + "\n")
    print(
        f"wrote {HERE}/train.txt ({len(train)} stories, {size / 1e6:.1f} MB) and valid.txt ({valid_stories} stories)"
    )


if __name__ == "__main__":
    main()
