"""A conversation rendered to text, with the character spans that are supervised (and the
images its image placeholders stand for, in order)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Rendered:
    """Rendered text plus the [start, end) character spans the model generates (the replies)."""

    text: str
    spans: list[tuple[int, int]]
    # Image files, one per image placeholder of ``text`` in order (vision-language data).
    images: list[str] = field(default_factory=list)

    @classmethod
    def from_pieces(cls, pieces: list[tuple[str, bool]]) -> Rendered:
        """Join (text, supervised) pieces; adjacent supervised pieces stay separate spans."""
        text, spans = "", []
        for piece, supervised in pieces:
            if supervised and piece:
                spans.append((len(text), len(text) + len(piece)))
            text += piece
        return cls(text, spans)

    def segments(self) -> list[tuple[str, bool]]:
        """The text cut at span edges: (piece, supervised) in order."""
        pieces, cursor = [], 0
        for start, end in self.spans:
            if start > cursor:
                pieces.append((self.text[cursor:start], False))
            pieces.append((self.text[start:end], True))
            cursor = end
        if cursor < len(self.text):
            pieces.append((self.text[cursor:], False))
        return pieces

    def last_turn_only(self) -> Rendered:
        return Rendered(self.text, self.spans[-1:], self.images)
