"""The German sentence splitter: a table of texts and the sentences they split into, and whitespace kept exactly."""

from __future__ import annotations

import pytest

from nmt_serve.model.sentences import join, split_sentences, split_spans

CASES: list[tuple[str, list[str]]] = [
    # plain sentences and their terminators
    ("Ich sehe den Hund.", ["Ich sehe den Hund."]),
    ("Ich sehe den Hund. Er schläft.", ["Ich sehe den Hund.", "Er schläft."]),
    ("Wo ist der Bahnhof? Dort drüben!", ["Wo ist der Bahnhof?", "Dort drüben!"]),
    ("Wirklich?! Ja. Gut.", ["Wirklich?!", "Ja.", "Gut."]),
    ("Ohne Punkt am Ende", ["Ohne Punkt am Ende"]),
    ("Erster Satz.Zweiter ohne Leerzeichen.", ["Erster Satz.Zweiter ohne Leerzeichen."]),
    # abbreviations
    ("Wir brauchen z. B. Mehl und Zucker.", ["Wir brauchen z. B. Mehl und Zucker."]),
    ("Wir brauchen z.B. Mehl. Dann backen wir.", ["Wir brauchen z.B. Mehl.", "Dann backen wir."]),
    ("Das ist d. h. Das Ende.", ["Das ist d. h. Das Ende."]),
    ("Er hat u. a. Bücher gekauft.", ["Er hat u. a. Bücher gekauft."]),
    ("Er wohnt in der Hauptstr. 5 in Berlin.", ["Er wohnt in der Hauptstr. 5 in Berlin."]),
    ("Sprechen Sie mit Dr. Müller. Er hilft.", ["Sprechen Sie mit Dr. Müller.", "Er hilft."]),
    ("Prof. Schmidt und Hr. Meier kommen.", ["Prof. Schmidt und Hr. Meier kommen."]),
    ("Fr. Weber ist da. Sie wartet.", ["Fr. Weber ist da.", "Sie wartet."]),
    ("Siehe Nr. 7 bzw. Nr. 8 im Katalog.", ["Siehe Nr. 7 bzw. Nr. 8 im Katalog."]),
    ("Es kostet ca. 20 Euro.", ["Es kostet ca. 20 Euro."]),
    ("Vgl. Kapitel 3. Dort steht es.", ["Vgl. Kapitel 3.", "Dort steht es."]),
    ("Bringen Sie evtl. Geld mit. Ggf. auch Karten.", ["Bringen Sie evtl. Geld mit.", "Ggf. auch Karten."]),
    ("Äpfel, Birnen usw. Dann kamen die Gäste.", ["Äpfel, Birnen usw.", "Dann kamen die Gäste."]),
    ("Er kam im Okt. Zurück war er im Dez. wieder.", ["Er kam im Okt. Zurück war er im Dez. wieder."]),
    ("J. S. Bach schrieb viel Musik.", ["J. S. Bach schrieb viel Musik."]),
    # ordinals, numbers, dates, times
    ("Wir treffen uns am 3. Oktober in Bonn.", ["Wir treffen uns am 3. Oktober in Bonn."]),
    ("Er belegte den 2. Platz. Sie gewann.", ["Er belegte den 2. Platz.", "Sie gewann."]),
    ("Das Fest ist am 24. Dez. und dauert lange.", ["Das Fest ist am 24. Dez. und dauert lange."]),
    ("Er ist 1. Mai geboren.", ["Er ist 1. Mai geboren."]),
    ("Der Wert ist 3.5 Prozent.", ["Der Wert ist 3.5 Prozent."]),
    ("Der Zug fährt um 12.30 Uhr. Sei pünktlich.", ["Der Zug fährt um 12.30 Uhr.", "Sei pünktlich."]),
    ("Am 1.1.2024 begann das Jahr. Es war kalt.", ["Am 1.1.2024 begann das Jahr.", "Es war kalt."]),
    ("Wir zählten bis 3. Dann liefen wir.", ["Wir zählten bis 3. Dann liefen wir."]),
    ("Das Ergebnis war 42. Niemand glaubte es.", ["Das Ergebnis war 42.", "Niemand glaubte es."]),
    # quotes and brackets
    ("„Komm!“ sagte er.", ["„Komm!“ sagte er."]),
    ('"Komm!" sagte er.', ['"Komm!" sagte er.']),
    ("Er rief: „Komm!“ Dann ging er.", ["Er rief: „Komm!“", "Dann ging er."]),
    ("Sie sagte: „Ich bin müde.“ Er nickte.", ["Sie sagte: „Ich bin müde.“", "Er nickte."]),
    ("»Wohin?« fragte sie.", ["»Wohin?« fragte sie."]),
    ("Er lachte (das war selten.) Dann ging er.", ["Er lachte (das war selten.)", "Dann ging er."]),
    # ellipsis
    ("Ich weiß nicht... Vielleicht morgen.", ["Ich weiß nicht...", "Vielleicht morgen."]),
    ("Er ging … und kam zurück.", ["Er ging … und kam zurück."]),
    ("Warte… Jetzt!", ["Warte…", "Jetzt!"]),
    # URLs, e-mail addresses, file paths
    ("Besuchen Sie www.example.de/info.html. Dort steht mehr.", ["Besuchen Sie www.example.de/info.html.", "Dort steht mehr."]),
    ("Schreiben Sie an info@example.de. Wir antworten.", ["Schreiben Sie an info@example.de.", "Wir antworten."]),
    ("Die Datei /etc/nginx/nginx.conf fehlt.", ["Die Datei /etc/nginx/nginx.conf fehlt."]),
    ("Siehe https://de.wikipedia.org/wiki/Bonn. Danke.", ["Siehe https://de.wikipedia.org/wiki/Bonn.", "Danke."]),
    ("Öffnen Sie C:\\Programme\\app.exe. Fertig.", ["Öffnen Sie C:\\Programme\\app.exe.", "Fertig."]),
    # lines, lists and paragraphs
    ("Erster Absatz.\n\nZweiter Absatz.", ["Erster Absatz.", "Zweiter Absatz."]),
    ("Titel ohne Punkt\n\nText darunter.", ["Titel ohne Punkt", "Text darunter."]),
    ("Einkaufsliste:\n- Mehl\n- Zucker\n- Eier", ["Einkaufsliste:", "- Mehl", "- Zucker", "- Eier"]),
    ("* Punkt eins\n* Punkt zwei", ["* Punkt eins", "* Punkt zwei"]),
    ("1. Aufstehen\n2. Frühstücken\n3. Gehen", ["1. Aufstehen", "2. Frühstücken", "3. Gehen"]),
    ("• Erstens\n• Zweitens", ["• Erstens", "• Zweitens"]),
    ("Dieser Satz ist\numbrochen worden.", ["Dieser Satz ist\numbrochen worden."]),
    ("Erste Zeile.\nZweite Zeile.", ["Erste Zeile.", "Zweite Zeile."]),
    ("Zeile eins\r\n\r\nZeile zwei", ["Zeile eins", "Zeile zwei"]),
    # whitespace at the edges and blank texts
    ("  Hallo. Tschüss.  ", ["Hallo.", "Tschüss."]),
    ("\n\nHallo.\n", ["Hallo."]),
    ("", []),
    ("   \n\t ", []),
]


@pytest.mark.parametrize(("text", "expected"), CASES, ids=[f"case{index}" for index in range(len(CASES))])
def test_split_sentences_matches_the_table(text: str, expected: list[str]) -> None:
    assert split_sentences(text) == expected


@pytest.mark.parametrize(("text", "expected"), CASES, ids=[f"case{index}" for index in range(len(CASES))])
def test_join_of_identity_translations_is_the_input(text: str, expected: list[str]) -> None:
    spans = split_spans(text)
    assert join(text, spans, [text[start:end] for start, end in spans]) == (text if expected else "")


def test_split_spans_never_cover_edge_whitespace() -> None:
    for text, _ in CASES:
        for start, end in split_spans(text):
            assert not text[start].isspace() and not text[end - 1].isspace()


def test_join_keeps_spaces_newlines_and_paragraph_breaks() -> None:
    text = "  Guten Morgen.\n\nWie geht es?   Gut.\n"
    spans = split_spans(text)
    assert join(text, spans, ["Good morning.", "How are you?", "Fine."]) == "  Good morning.\n\nHow are you?   Fine.\n"


def test_join_refuses_a_count_mismatch() -> None:
    with pytest.raises(ValueError, match="2 spans but 1 translations"):
        join("Eins. Zwei.", split_spans("Eins. Zwei."), ["One."])


class CountingText(str):
    """A text that counts the characters the splitter reads from it by index or slice (its work, as a count)."""

    read = 0

    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        part = str.__getitem__(self, key)
        CountingText.read += len(part)
        return part


@pytest.mark.parametrize("line", ["a\n", "Ein Satz ohne Ende\n", "- Punkt.\n", "Ja.\n\n"])
def test_split_spans_reads_each_character_a_bounded_number_of_times(line: str) -> None:
    """Wrapped lines join one sentence: each line must not reread the lines before it (1,000 lines once cost a
    million characters read)."""
    for lines in (100, 1000):
        CountingText.read = 0
        text = CountingText(line * lines)
        split_spans(text)
        assert CountingText.read <= 4 * len(text), (lines, CountingText.read)


def test_split_spans_stops_one_span_past_max_spans() -> None:
    text = CountingText("- Punkt\n" * 1000)
    CountingText.read = 0
    assert split_spans(text, max_spans=64) == split_spans(str(text))[:65]
    assert CountingText.read <= 4 * len("- Punkt\n") * 65  # the 935 lines after the 65th are never read
