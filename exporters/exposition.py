"""``/metrics`` rendered with each series' label string kept between scrapes.

prometheus_client renders every sample from scratch: it sorts the sample's labels, escapes each
value and joins them, about 20 µs a sample. The training families hold most of the agent's
samples (up to ``max_series`` series times eleven families), with the active alerts (one per
firing series and rule), and their label sets stay the same from one scrape to the next, so ``RowFamily`` keeps their samples as rows (label values, value)
and ``Renderer`` writes each row as its sample name, the label string the installed
prometheus_client made for that label set the first time it was seen (kept while the series is
exported, per negotiated format), and the value through prometheus_client's own float formatting.

Everything else is prometheus_client's own output: the other families, each row family's
``# HELP``/``# TYPE`` lines (rendered from the family without its samples), the format chosen
from the ``Accept`` header, the ``# EOF`` of OpenMetrics, gzip. The result is byte-for-byte what
``make_wsgi_app`` serves (tests/exporters/test_exposition.py compares both formats and escapings);
a ``RowFamily`` read any other way (``.samples``, a ``name[]`` filter) gives the usual samples.
"""

from __future__ import annotations

import gzip
import threading
from typing import Any, Callable, Iterable, Iterator, Sequence
from urllib.parse import parse_qs

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

Encoder = Callable[[Any], bytes]
FORMATS_KEPT = 2      # label-string caches kept, one per negotiated content type (Prometheus', a person's)
GZIP_LEVEL = 6        # prometheus_client compresses at 9: twice the CPU for ~1 % less on this text


class RowFamily(Metric):
    """A gauge or counter family whose samples are rows of label values (in ``label_names``
    order) and a value. ``Renderer`` writes them with cached label strings; ``samples`` gives
    them as prometheus_client samples to anything else."""

    def __init__(self, name: str, documentation: str, typ: str, label_names: Sequence[str]) -> None:
        if typ not in ("gauge", "counter"):
            raise ValueError(f"RowFamily is a gauge or a counter, not {typ!r}")
        super().__init__(name, documentation, typ)
        self.label_names = tuple(label_names)
        self.rows: list[tuple[tuple[str, ...], float]] = []

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.type == "counter" else self.name

    def add(self, values: Sequence[str], value: float) -> None:
        if len(values) != len(self.label_names):
            raise ValueError("label values do not match the label names")
        self.rows.append((tuple(values), value))

    def add_sample(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a RowFamily takes its samples through add()")

    @property  # type: ignore[override]
    def samples(self) -> list[Sample]:
        name, keys = self.sample_name, self.label_names
        return [Sample(name, dict(zip(keys, values)), value) for values, value in self.rows]

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        if value:  # Metric.__init__ sets []: rows come through add()
            raise TypeError("a RowFamily takes its samples through add()")


class _Families:
    """What an encoder reads: a registry of the given families."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


class Renderer:
    """Renders a registry in the format an encoder of ``choose_encoder`` writes, with the row
    families' label strings kept from one scrape to the next (only those of the families and
    label sets of the latest scrape in that format: bounded by what is exported)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # content type -> {label names: {values: label string}, sample name: the name as written}
        self._formats: dict[str, dict] = {}

    def kept(self) -> int:
        """Label strings kept, over all formats."""
        with self._lock:
            return sum(len(v) for cache in self._formats.values() for v in cache.values() if isinstance(v, dict))

    def formats(self) -> int:
        """Formats (content types) whose label strings are kept."""
        with self._lock:
            return len(self._formats)

    def render(self, registry: Any, encoder: Encoder, content_type: str) -> bytes:
        tail = encoder(_Families(()))         # b"# EOF\n" in OpenMetrics, b"" in the text format
        out: list[bytes] = []
        plain: list[Metric] = []
        with self._lock:
            old = self._formats.pop(content_type, {})
            new: dict = {}
            for family in registry.collect():
                if isinstance(family, RowFamily):
                    if plain:
                        out.append(_strip(encoder(_Families(plain)), tail))
                        plain = []
                    out.append(self._rows(family, encoder, tail, old, new))
                else:
                    plain.append(family)
            self._formats[content_type] = new
            while len(self._formats) > FORMATS_KEPT:
                self._formats.pop(next(iter(self._formats)))
        if plain:
            out.append(_strip(encoder(_Families(plain)), tail))
        out.append(tail)
        return b"".join(out)

    @staticmethod
    def _rows(family: RowFamily, encoder: Encoder, tail: bytes, old: dict, new: dict) -> bytes:
        head = Metric(family.name, family.documentation, family.type)
        text = [_strip(encoder(_Families([head])), tail).decode("utf-8")]
        name, keys = family.sample_name, family.label_names
        # label strings by label names, then by label values: a row's lookup hashes its values only
        old_k, new_k = old.get(keys, {}), new.setdefault(keys, {})
        missing = list(dict.fromkeys(values for values, _ in family.rows
                                     if values not in new_k and values not in old_k))
        if missing or name not in old and name not in new:
            # one rendering by prometheus_client of the sample name as the format escapes it, then
            # of every label set not seen before
            probe = Metric(family.name, "", family.type)
            probe.add_sample(name, {}, 0.0)
            for values in missing:
                probe.add_sample(name, dict(zip(keys, values)), 0.0)
            lines = _strip(encoder(_Families([probe])), tail).decode("utf-8").split("\n")
            samples = [ln for ln in lines if ln and not ln.startswith("#")]
            if len(samples) != len(missing) + 1:
                raise RuntimeError(f"prometheus_client rendered {len(samples)} samples of {len(missing) + 1}")
            escaped = old[name] = samples[0][:samples[0].rindex(" ")]
            for values, line in zip(missing, samples[1:]):
                if not line.startswith(escaped):
                    raise RuntimeError(f"prometheus_client rendered {line!r} for a sample of {escaped!r}")
                new_k[values] = line[len(escaped):line.rindex(" ")]   # name{...} 0.0 -> {...}
        escaped = new.get(name) or old[name]
        new[name] = escaped
        for values, value in family.rows:
            labels = new_k.get(values)
            if labels is None:
                labels = new_k[values] = old_k[values]
            text.append(f"{escaped}{labels} {floatToGoString(value)}\n")
        return "".join(text).encode("utf-8")


def _strip(body: bytes, tail: bytes) -> bytes:
    return body[:-len(tail)] if tail and body.endswith(tail) else body


def _gzip_accepted(header: str | None) -> bool:
    return any(part.split(";")[0].strip().lower() == "gzip" for part in (header or "").split(","))


def metrics_app(registry: Any) -> Callable:
    """The ``/metrics`` WSGI app: a GET is rendered by ``Renderer``; anything else (another
    method, a ``name[]`` filter) goes to prometheus_client's own ``make_wsgi_app``."""
    fallback = make_wsgi_app(registry)
    renderer = Renderer()

    def app(environ: dict[str, Any], start_response: Callable) -> list[bytes]:
        if environ.get("REQUEST_METHOD") != "GET" or "name[]" in parse_qs(environ.get("QUERY_STRING", "")):
            return fallback(environ, start_response)
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT"))
        body = renderer.render(registry, encoder, content_type)
        headers = [("Content-Type", content_type)]
        if _gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING")):
            body = gzip.compress(body, compresslevel=GZIP_LEVEL)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]
    return app
