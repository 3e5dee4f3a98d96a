"""A multipart/form-data upload read as it arrives (python-multipart's streaming parser): its text
fields, and its one file's bytes handed on in chunks of `FILE_CHUNK`, so that a 64 MiB file is
never whole in the gateway, nor copied."""

from __future__ import annotations

from python_multipart.multipart import MultipartParser, parse_options_header

from raylane.deployments.protocol.errors import invalid

FILE_CHUNK = 2**20  # bytes of the file handed on at once (to the batch actor)
MAX_FIELD_BYTES = 1024  # of a text field kept (`purpose` is all the form needs)
MAX_FILENAME = 256


def boundary_of(content_type: str) -> bytes:
    """The form's boundary, or a 400 when the body is not multipart/form-data."""
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise invalid("file", "Upload the file as multipart/form-data (fields `file` and `purpose`).")
    return boundary


class FormReader:
    """Feed it the body's chunks (`write`); take the file's bytes as they pile up (`take`)."""

    def __init__(self, boundary: bytes) -> None:
        self.fields: dict[str, str] = {}
        self.filename: str | None = None  # of the file part, once its headers are read
        self._pending = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._header_field = self._header_value = b""
        self._field: tuple[str, bytearray] | None = None  # the text field being read
        self._in_file = False
        callbacks = {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda data, start, end: self._add_header(field=data[start:end]),
            "on_header_value": lambda data, start, end: self._add_header(value=data[start:end]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }
        self._parser = MultipartParser(boundary, callbacks)

    def write(self, chunk: bytes) -> None:
        try:
            self._parser.write(chunk)
        except ValueError as e:  # python-multipart's errors for a malformed body
            raise invalid("file", f"The multipart form could not be read: {e}.") from None

    def finalize(self) -> None:
        try:
            self._parser.finalize()
        except ValueError as e:
            raise invalid("file", f"The multipart form could not be read: {e}.") from None

    def take(self, at_least: int = FILE_CHUNK) -> bytes | None:
        """The file's bytes read since the last take, when there are `at_least` of them."""
        if not self._pending or len(self._pending) < at_least:
            return None
        data = bytes(self._pending)
        self._pending.clear()
        return data

    def _part_begin(self) -> None:
        self._headers = {}

    def _add_header(self, field: bytes = b"", value: bytes = b"") -> None:
        self._header_field += field
        self._header_value += value

    def _header_end(self) -> None:
        self._headers[self._header_field.lower()] = self._header_value
        self._header_field = self._header_value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        if b"filename" in options:
            if self.filename is not None:
                raise invalid("file", "Upload one file at a time.")
            self.filename = options[b"filename"].decode(errors="replace")[:MAX_FILENAME]
            self._in_file = True
        else:
            self._field = (options.get(b"name", b"").decode(errors="replace"), bytearray())

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self._pending += data[start:end]
        elif self._field is not None and len(self._field[1]) < MAX_FIELD_BYTES:
            self._field[1].extend(data[start : min(end, start + MAX_FIELD_BYTES - len(self._field[1]))])

    def _part_end(self) -> None:
        if self._field is not None:
            name, value = self._field
            self.fields[name] = value.decode(errors="replace")
        self._field, self._in_file = None, False
