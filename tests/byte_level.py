"""GPT-2's byte-to-unicode table, written out independently of specdec for the tokenizer tests."""


def bytes_to_unicode() -> dict[int, str]:
    """Each byte 0..255 -> the printable character byte-level BPE vocabularies spell it with."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
