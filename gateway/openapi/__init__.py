"""The OpenAPI schema at /schema/openapi.json and a docs page at /schema.

Most handlers decode their raw body with msgspec (for precise errors) and return dicts,
so Litestar cannot see their shapes: each route names them with `documented(...)`, its
operation class, most through `route(...)`, which sets the route's status from it too.
The msgspec structs' JSON Schemas (msgspec's own, exactly what the decoders accept) join
the document's components when it is served. The docs page is rendered here, on the
server: no script or stylesheet from a CDN."""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from importlib.metadata import version
from typing import Any

import msgspec
from litestar import Request
from litestar.enums import ParamType
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin, OpenAPIRenderPlugin
from litestar.openapi.spec import (
    Components,
    Discriminator,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    Parameter,
    Reference,
    RequestBody,
    Schema,
    SecurityScheme,
)

from gateway.openapi.shapes import ErrorResponse, StreamError

REF = "#/components/schemas/{name}"

ERRORS = {
    400: "Invalid request: a field missing, of the wrong type or out of range (`param` "
    "names it); `context_length_exceeded` when the prompt does not fit the model",
    401: "Missing, invalid or revoked API key",
    402: "The batch's worst case costs more than the budget has left (`batch_over_budget`)",
    403: "This key may not do this: an admin key is needed, or the plan excludes the model",
    404: "No such model, tenant, plan, key, price or request",
    409: "Conflicts with what exists: a name taken, an export already running; or a "
    "request with this `Idempotency-Key` is still in flight (`idempotency_key_in_flight`, "
    "with `Retry-After`)",
    413: "The request body is larger than the gateway accepts",
    422: "This `Idempotency-Key` was used with a different body (`idempotency_key_reused`): "
    "a retry must send the same request",
    429: "A rate, concurrency or budget limit is used up (`Retry-After` says when to retry; "
    "`x-should-retry: false` when the month's budget is spent)",
    503: "Overloaded, or the engine, database or quota store unavailable: retry shortly",
    504: "The first token did not come within `ttft_deadline_ms`, or the request timed out",
}
# Every authenticated route: a bad key, a malformed parameter, a store that is down.
AUTHENTICATED = (400, 401, 503)
ADMIN = (*AUTHENTICATED, 403, 404)
ADMIN_WRITE = (*ADMIN, 409, 413)
GENERATION = (*AUTHENTICATED, 403, 404, 409, 413, 422, 429, 504)
SSE = "text/event-stream"
IDEMPOTENCY_KEY = Parameter(
    name="Idempotency-Key",
    param_in=ParamType.HEADER,
    required=False,
    schema=Schema(type=OpenAPIType.STRING, min_length=1, max_length=255),
    description="1-255 printable ASCII characters, unique per request (IETF "
    "draft-ietf-httpapi-idempotency-key-header): a retry with the same key and body within "
    "the retention window (24 h by default) gets the stored answer, a stream's included, "
    "and is not charged again; 409 while the first is in flight, 422 for another body, "
    "400 for a malformed key",
)

# The JSON Schemas of every struct a route names, by component name.
_COMPONENTS: dict[str, Any] = {}


def documented(
    ok: Any,
    *,
    body: type | None = None,
    errors: Iterable[int] = (),
    status: int = 200,
    media_type: str = "application/json",
    stream: type | None = None,
    secured: bool = True,
    also: Mapping[int, tuple[str, Any]] | None = None,
    idempotent: bool = False,
) -> type[Operation]:
    """The operation class of a route answering `ok` (a type msgspec can describe) with
    `status`, refusing with `errors`; `body`: the struct its request body decodes to;
    `ok` None: no body (204); `stream`: the struct each event's `data` holds when it can
    answer in server-sent events; `also`: other answers, by status, with their
    description and shape; `idempotent`: it takes an Idempotency-Key header."""
    content = {} if ok is None else {media_type: OpenAPIMediaType(schema=schema_of(ok))}
    if stream is not None:
        content[SSE] = OpenAPIMediaType(schema=_event_schema(stream))
    responses = {str(status): OpenAPIResponse(description="Success", content=content)}
    for code in errors:
        shape = {"application/json": OpenAPIMediaType(schema=schema_of(ErrorResponse))}
        responses[str(code)] = OpenAPIResponse(description=ERRORS[code], content=shape)
    for code, (description, kind) in (also or {}).items():
        shape = {"application/json": OpenAPIMediaType(schema=schema_of(kind))}
        responses[str(code)] = OpenAPIResponse(description=description, content=shape)
    request_body = None
    if body is not None:
        shape = {"application/json": OpenAPIMediaType(schema=schema_of(body))}
        request_body = RequestBody(content=shape, required=True)
    headers = [IDEMPOTENCY_KEY] if idempotent else []

    @dataclass
    class Documented(Operation):
        def __post_init__(self) -> None:
            self.responses = responses  # type: ignore[assignment]
            self.request_body = request_body
            self.security = [{"bearer": []}] if secured else None
            self.parameters = [*(self.parameters or []), *headers] or None

    return Documented


def route(
    method: Callable[..., HTTPRouteHandler],
    path: str,
    ok: Any,
    *,
    status: int = 200,
    **documentation: Any,
) -> HTTPRouteHandler:
    """The route `method(path)` (litestar's get, post, …) answering `ok` with `status`,
    documented by `documented(ok, status=status, **documentation)`: the status is named
    once, so what the route answers and what its document says cannot drift apart."""
    operation = documented(ok, status=status, **documentation)
    return method(path, status_code=status, operation_class=operation)


def shaped(shape: type[msgspec.Struct], row: object, **computed: Any) -> dict[str, Any]:
    """`row` answered as `shape` documents it: the shape's fields, in its order, each from
    `computed` where given there, else `row`'s attribute of that name."""
    return {
        name: computed[name] if name in computed else getattr(row, name)
        for name in shape.__struct_fields__
    }


def _event_schema(stream: type) -> Schema:
    """One server-sent event, as OpenAPI 3.1 tools parse a `text/event-stream` (the
    schema describes each event, not the whole body): its `data` is a `stream` as JSON
    (contentSchema), or a StreamError where an error cut the stream short, or `[DONE]`,
    the last event of a chat or completions stream; the Responses stream names each
    event too (`event:`)."""
    name = stream.__name__
    chunk = Schema(one_of=[schema_of(stream), schema_of(StreamError)])
    data = Schema(
        type=OpenAPIType.STRING,
        content_media_type="application/json",
        content_schema=chunk,
        description=f"a {name} as JSON (a StreamError if an error cut the stream short), or [DONE]",
    )
    return Schema(
        type=OpenAPIType.OBJECT,
        properties={"data": data, "event": Schema(type=OpenAPIType.STRING)},
        required=["data"],
        description=f"Server-sent events: `data: <{name}>` lines",
    )


def schema_of(kind: Any) -> Schema | Reference:
    """`kind`'s JSON Schema, its structs kept as components."""
    (top,), components = msgspec.json.schema_components([kind], ref_template=REF)
    for name, schema in components.items():
        if _COMPONENTS.setdefault(name, schema) != schema:
            raise TypeError(f"two different shapes are both named {name}")
    return _as_spec(top)


_SPEC_FIELDS = {
    field.metadata.get("alias", _camel): field.name
    for field in fields(Schema)
    for _camel in ["".join(w if i == 0 else w.title() for i, w in enumerate(field.name.split("_")))]
}


def _as_spec(node: dict[str, Any]) -> Schema | Reference:
    """msgspec's JSON Schema as Litestar's spec objects."""
    if "$ref" in node:
        return Reference(ref=node["$ref"])
    spec: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            value = _as_spec(value)
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            value = [_as_spec(v) for v in value]
        elif key == "properties":
            value = {name: _as_spec(v) for name, v in value.items()}
        elif key == "discriminator":
            value = Discriminator(property_name=value["propertyName"], mapping=value["mapping"])
        spec[_SPEC_FIELDS[key]] = value
    return Schema(**spec)


def complete(document: dict[str, Any], models: list[str] | None = None) -> dict[str, Any]:
    """The document Litestar built, with the structs' schemas among its components; with
    `models`, a request's `model` is one of the names served now (the registry's
    changes show at the next fetch)."""
    schemas = {**(document.get("components") or {}).get("schemas", {}), **_COMPONENTS}
    if models:
        schemas = {name: _served(name, schema, models) for name, schema in schemas.items()}
    components = {**(document.get("components") or {}), "schemas": schemas}
    return {**document, "components": components}


# The request bodies that name a model to run (not, e.g., a price's model).
MODEL_REQUESTS = frozenset(
    ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "EmbeddingRequest")
)


def _served(name: str, schema: dict[str, Any], models: list[str]) -> dict[str, Any]:
    model = schema.get("properties", {}).get("model")
    if name not in MODEL_REQUESTS or model is None or model.get("type") != "string":
        return schema
    properties = {**schema["properties"], "model": {**model, "enum": models}}
    return {**schema, "properties": properties}


def _served_models(request: Request[Any, Any, Any]) -> list[str]:
    runtime = getattr(request.app.state, "runtime", None)
    models = getattr(runtime, "models", None)
    return models.names() if models is not None else []


class SchemaDocument(JsonRenderPlugin):
    """/schema/openapi.json"""

    def render(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        return self.render_json(request, complete(openapi_schema, _served_models(request)))


class DocsPage(OpenAPIRenderPlugin):
    """/schema: every operation with its parameters, body and answers, then the shapes."""

    def __init__(self) -> None:
        super().__init__(path="/", favicon="", style=_STYLE)

    def render(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        document = complete(openapi_schema)
        parts = [
            f"<!doctype html><html><head><meta charset='utf-8'>{self.style}"
            f"<title>{_e(document['info']['title'])} API</title></head><body>",
            f"<h1>{_e(document['info']['title'])} API {_e(document['info']['version'])}</h1>",
            f"<p>The OpenAPI document: <a href='{self.get_openapi_json_route(request)}'>"
            "openapi.json</a>. Authenticate with <code>Authorization: Bearer &lt;key&gt;"
            "</code>.</p>",
        ]
        for path, item in document.get("paths", {}).items():
            for method, operation in item.items():
                parts.append(_operation_html(method, path, operation))
        parts.append("<h2>Shapes</h2>")
        for name, schema in sorted(document["components"]["schemas"].items()):
            text = _e(json.dumps(schema, indent=2))
            parts.append(f"<details id='{_e(name)}'><summary>{_e(name)}</summary>")
            parts.append(f"<pre>{text}</pre></details>")
        parts.append("</body></html>")
        return "".join(parts).encode()


_STYLE = (
    "<style>body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;"
    "padding:0 1rem}code,pre{background:#f4f4f4}pre{padding:.5rem;overflow:auto}"
    "h3{margin-bottom:.2rem}td{padding:0 .6rem;vertical-align:top}</style>"
)


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _operation_html(method: str, path: str, operation: dict[str, Any]) -> str:
    out = [f"<h3>{_e(method.upper())} <code>{_e(path)}</code></h3>"]
    if "description" in operation or "summary" in operation:
        out.append(f"<p>{_e(operation.get('description') or operation['summary'])}</p>")
    for parameter in operation.get("parameters", []):
        out.append(
            f"<div>{_e(parameter['in'])} parameter <code>{_e(parameter['name'])}</code>: "
            f"{_shape_html(parameter.get('schema', {}))}</div>"
        )
    body = operation.get("requestBody", {}).get("content", {}).get("application/json")
    if body is not None:
        out.append(f"<div>Body: {_shape_html(body['schema'])}</div>")
    out.append("<table>")
    for code, answer in operation.get("responses", {}).items():
        shapes = ", ".join(
            f"{_e(media)} {_shape_html(c.get('schema', {}))}"
            for media, c in answer.get("content", {}).items()
        )
        out.append(f"<tr><td>{_e(code)}</td><td>{_e(answer['description'])}</td>")
        out.append(f"<td>{shapes}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _shape_html(schema: dict[str, Any]) -> str:
    """A schema in a few words, its components linked to their section below."""
    text = _e(json.dumps(schema))
    for ref in set(_refs(schema)):
        name = _e(ref.removeprefix(REF.format(name="")))
        text = text.replace(_e(json.dumps({"$ref": ref})), f"<a href='#{name}'>{name}</a>")
    return f"<code>{text}</code>"


def _refs(node: Any) -> Iterable[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def openapi_config() -> OpenAPIConfig:
    bearer = SecurityScheme(type="http", scheme="bearer", description="A Tollgate API key")
    return OpenAPIConfig(
        title="Tollgate",
        version=version("tollgate"),
        path="/schema",
        render_plugins=[DocsPage(), SchemaDocument()],
        components=Components(security_schemes={"bearer": bearer}),
        use_handler_docstrings=True,
    )
