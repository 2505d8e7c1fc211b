"""What is kept for a key: OpenAI's Responses API (state in Redis:
serve_app/stored/responses_api.py), and its Files and Batch API (state in Redis and the
files directory: serve_app/stored/files_api.py, batches.py; run by
serve_app/stored/batch_runner.py). Each call is admitted like any request of its key."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from redis.exceptions import RedisError
from starlette.datastructures import UploadFile
from starlette.responses import FileResponse, JSONResponse, Response

from contract.replica_wire import Usage
from serve_app.admission.seam import Refusal
from serve_app.errors import OpenAIError
from serve_app.http.request_handling import serve_request_id
from serve_app.http.routes.table import IngressRoutes, route
from serve_app.identity.jwt_auth import is_jwt_identity
from serve_app.identity.keys import KeyRecord
from serve_app.pipeline.refusals import render as render_refusal
from serve_app.stored import responses_api
from serve_app.stored.files_api import PURPOSES, safe_filename, storage_full
from serve_app.stored.stored_responses import item_list
from serve_app.stored.upload_form import read_upload_form
from serve_app.wire.api_requests import list_params, parse_json_object


class StoredRoutes(IngressRoutes):
    """Stored Responses, Files and Batches of the caller's key."""

    @route("POST", "/v1/responses", "key")
    async def create_response(self, request: Request) -> Response:
        return await self._handle(
            "openai", request, lambda body, key: responses_api.translate(body, key, self.responses)
        )

    @route("GET", "/v1/responses/{response_id}", "key")
    async def retrieve_response(self, response_id: str, request: Request) -> Response:
        async def retrieve(key: KeyRecord) -> dict[str, Any]:
            return (await responses_api.retrieve(self.responses, key, response_id))["response"]

        return await self._stored(request, retrieve)

    @route("DELETE", "/v1/responses/{response_id}", "key")
    async def delete_response(self, response_id: str, request: Request) -> Response:
        return await self._stored(request, lambda key: responses_api.delete(self.responses, key, response_id))

    @route("GET", "/v1/responses/{response_id}/input_items", "key")
    async def response_input_items(self, response_id: str, request: Request) -> Response:
        params = list_params(request.query_params)

        async def items(key: KeyRecord) -> dict[str, Any]:
            stored = await responses_api.retrieve(self.responses, key, response_id)
            return item_list(stored["input_items"], **params)

        return await self._stored(request, items)

    async def _stored(self, request: Request, work) -> Response:
        """``work(key)`` for the caller's key, admitted like any request of it
        (requests/min and a concurrency slot, no tokens: an upload holds its slot
        while it is read); Redis unreachable is a 503."""
        key = await self.authenticator.authenticate(request.headers)
        ticket = await self.gate.admit(key, "", 0, serve_request_id(request))
        if isinstance(ticket, Refusal):
            raise render_refusal(ticket)
        try:
            answer = await work(key)
        except RedisError:
            self.gate.settle(ticket, "failed", Usage())
            raise OpenAIError(
                503,
                "Files, batches and stored responses are unavailable right now. Please retry shortly.",
                code="store_unavailable",
                headers={**ticket.headers, "retry-after": "1"},
            ) from None
        except OpenAIError as exc:
            self.gate.settle(ticket, "failed", Usage())
            exc.headers = {**ticket.headers, **exc.headers}
            raise
        except BaseException:
            self.gate.settle(ticket, "failed", Usage())
            raise
        self.gate.settle(ticket, "completed", Usage())
        response = answer if isinstance(answer, Response) else JSONResponse(answer)
        response.headers.update(ticket.headers)
        return response

    @route("POST", "/v1/files", "key", body="upload")
    async def create_file(self, request: Request) -> Response:
        async def upload(key: KeyRecord) -> dict[str, Any]:
            declared = request.headers.get("content-length", "")
            if not declared.isdigit():
                raise OpenAIError(411, "Send the upload with a Content-Length.", code="length_required")
            if int(declared) > self.files.max_bytes + 64 * 1024:  # the file plus its form's few fields
                raise OpenAIError(
                    413, f"The file is larger than {self.files.max_bytes} bytes.", param="file", code="file_too_large"
                )
            # The key's room first (no byte read, not even into the form's spool
            # file, for a key whose files are at their bound), then the form.
            async with self.files.reservation(key.id, int(declared)) as file_id:
                try:
                    form = await read_upload_form(request, max_files=1, max_fields=4)
                except OSError:  # the form's spool file (the temp directory) could not be written
                    raise storage_full() from None
                except Exception as exc:  # starlette's MultiPartException, or a body that is no form
                    raise OpenAIError(
                        400, f"Send the file as multipart/form-data with 'file' and 'purpose' ({exc}).", param="file"
                    ) from None
                try:
                    purpose, file = form.get("purpose"), form.get("file")
                    if purpose not in PURPOSES:
                        raise OpenAIError(
                            400,
                            f"Invalid 'purpose': {purpose!r}; this server stores files for {', '.join(PURPOSES)}.",
                            param="purpose",
                            code="invalid_value",
                        )
                    if not isinstance(file, UploadFile):
                        raise OpenAIError(
                            400, "Missing required parameter: 'file'.", param="file", code="missing_required_parameter"
                        )
                    return await self.files.upload(key.id, file_id, safe_filename(file.filename), purpose, file.file)
                finally:
                    await form.close()

        return await self._stored(request, upload)

    @route("GET", "/v1/files", "key")
    async def list_files(self, request: Request) -> Response:
        params = list_params(request.query_params, default_limit=10_000, max_limit=10_000)
        return await self._stored(
            request, lambda key: self.files.page(key.id, request.query_params.get("purpose"), **params)
        )

    @route("GET", "/v1/files/{file_id}", "key")
    async def retrieve_file(self, file_id: str, request: Request) -> Response:
        return await self._stored(request, lambda key: self.files.get(key.id, file_id))

    @route("DELETE", "/v1/files/{file_id}", "key")
    async def delete_file(self, file_id: str, request: Request) -> Response:
        return await self._stored(request, lambda key: self.files.delete(key.id, file_id))

    @route("GET", "/v1/files/{file_id}/content", "key")
    async def file_content(self, file_id: str, request: Request) -> Response:
        async def content(key: KeyRecord) -> Response:
            record = await self.files.get(key.id, file_id)
            return FileResponse(
                self.files.path(key.id, file_id), media_type="application/jsonl", filename=record["filename"]
            )

        return await self._stored(request, content)

    @route("POST", "/v1/batches", "key")
    async def create_batch(self, request: Request) -> Response:
        async def create(key: KeyRecord) -> dict[str, Any]:
            if is_jwt_identity(key.id):
                # Its runner reads the key again before each request; a token's user is
                # in no store to read (and its token expires long before 24 h).
                raise OpenAIError(
                    403, "Batches need an API key: an identity token cannot run a batch.", code="batch_needs_api_key"
                )
            return await self.batches.create(key.id, parse_json_object(await self._read_body(request)))

        return await self._stored(request, create)

    @route("GET", "/v1/batches", "key")
    async def list_batches(self, request: Request) -> Response:
        params = list_params(request.query_params)
        return await self._stored(request, lambda key: self.batches.page(key.id, params["limit"], params["after"]))

    @route("GET", "/v1/batches/{batch_id}", "key")
    async def retrieve_batch(self, batch_id: str, request: Request) -> Response:
        return await self._stored(request, lambda key: self.batches.get(key.id, batch_id))

    @route("POST", "/v1/batches/{batch_id}/cancel", "key")
    async def cancel_batch(self, batch_id: str, request: Request) -> Response:
        return await self._stored(request, lambda key: self.batches.cancel(key.id, batch_id))
