"""HTML pages put back together: each page's text translations rendered into its markup, rank by rank."""

from __future__ import annotations

from collections.abc import Sequence

from nmt_serve.model.html_text import HtmlDocument
from nmt_serve.protos.nmt.translation.v1 import translation_pb2 as pb


def rendered(documents: Sequence[HtmlDocument], translations: Sequence[pb.Translation]) -> list[pb.Translation]:
    """One Translation per page from the translations of all pages' texts, in page order (RequestReader's order)."""
    pages, cursor = [], 0
    for document in documents:
        nodes = translations[cursor : cursor + len(document.texts)]
        cursor += len(document.texts)
        pages.append(pb.Translation(hypotheses=page_hypotheses(document, nodes)))
    return pages


def page_hypotheses(document: HtmlDocument, nodes: Sequence[pb.Translation]) -> list[pb.Hypothesis]:
    """The page's k-th hypothesis holds each text's k-th (or its last, for a text with fewer); score: the mean of the texts'
    scores weighted by their token counts (at least 1 each); finish reason LENGTH when any text's is. The probes (inline
    elements' texts translated alone to place their tags) are not part of the page: they count in none of these."""
    if not nodes:
        return [pb.Hypothesis(text=document.render([]), score=0.0, token_count=0, finish_reason=pb.FINISH_REASON_EOS)]
    hypotheses = []
    for rank in range(max(len(node.hypotheses) for node in nodes)):
        every = [node.hypotheses[min(rank, len(node.hypotheses) - 1)] for node in nodes]
        picks = [pick for index, pick in enumerate(every) if index not in document.probes]
        weights = [max(pick.token_count, 1) for pick in picks]
        reason = pb.FINISH_REASON_LENGTH if any(pick.finish_reason == pb.FINISH_REASON_LENGTH for pick in picks) else pb.FINISH_REASON_EOS
        hypotheses.append(pb.Hypothesis(text=document.render([pick.text for pick in every]),
                                        score=sum(pick.score * weight for pick, weight in zip(picks, weights, strict=True)) / sum(weights),
                                        token_count=sum(pick.token_count for pick in picks), finish_reason=reason))  # fmt: skip
    return hypotheses
