"""One JSON error shape everywhere: {"error": {"code": ..., "message": ...}}."""
import logging

from flask import jsonify
from werkzeug.exceptions import HTTPException
from werkzeug.routing import IntegerConverter, ValidationError

log = logging.getLogger(__name__)


class ApiError(Exception):
    status = 400
    code = "BadRequest"

    def __init__(self, message, status=None, code=None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code


class BadRequest(ApiError):
    status, code = 400, "BadRequest"


class Unauthorized(ApiError):
    status, code = 401, "Unauthorized"


class WriteScopeError(ApiError):
    status, code = 403, "WriteScopeError"


class Forbidden(ApiError):
    status, code = 403, "Forbidden"


class NotFound(ApiError):
    status, code = 404, "NotFound"


class Conflict(ApiError):
    status, code = 409, "Conflict"


class PayloadTooLarge(ApiError):
    status, code = 413, "PayloadTooLarge"


class Unavailable(ApiError):
    status, code = 503, "Unavailable"


_HTTP_CODES = {
    400: ("BadRequest", "the request could not be read; send JSON with Content-Type: application/json"),
    404: ("NotFound", "no such route; the API lives under /api/v1/ (see docs/api.md)"),
    405: ("MethodNotAllowed", "this route does not take that method (see docs/api.md)"),
    413: ("PayloadTooLarge", "the body is too large; send smaller batches"),
}


def error_response(status, code, message):
    resp = jsonify({"error": {"code": code, "message": message}})
    resp.status_code = status
    return resp


class _Int64Converter(IntegerConverter):
    """`<int:...>` that matches only what fits an SQLite INTEGER: a larger id is a 404,
    not an OverflowError deep in a query."""

    def to_python(self, value):
        v = super().to_python(value)
        if v > MAX_INT:
            raise ValidationError()
        return v


MAX_INT = 2**63 - 1


def register(app):
    # Before any route is added: rules pick their converters when they are added.
    app.url_map.converters["int"] = _Int64Converter
    @app.errorhandler(ApiError)
    def _api_error(e):
        resp = error_response(e.status, e.code, e.message)
        if getattr(e, "retry_after", None):
            resp.headers["Retry-After"] = str(e.retry_after)
        return resp

    @app.errorhandler(HTTPException)
    def _http_error(e):
        code, message = _HTTP_CODES.get(e.code, (type(e).__name__, e.description))
        resp = error_response(e.code or 500, code, message)
        if e.code == 405 and getattr(e, "valid_methods", None):
            resp.headers["Allow"] = ", ".join(e.valid_methods)
        return resp

    @app.errorhandler(Exception)
    def _unexpected(e):
        from .db import LimitExceeded, PoolTimeout, is_write_failure
        if isinstance(e, LimitExceeded):
            return error_response(413, "PayloadTooLarge", str(e))
        if isinstance(e, PoolTimeout):
            log.error("a request waited too long for a database connection: %s", e)
            resp = error_response(503, "Unavailable",
                                  f"the server is too busy to read its database ({e}); "
                                  "retry in a few seconds")
            resp.headers["Retry-After"] = "5"
            return resp
        if is_write_failure(e):
            log.error("a write to the database failed: %s", e)
            return error_response(
                503, "Unavailable",
                f"the server cannot write to its database ({e}); whoever runs the server "
                "must free disk space or make its home writable; retry then")
        return error_response(500, "InternalError",
                              "the server failed on this request; see the server log")
