"""An OIDC provider's signing-key endpoint (JWKS) the tests run, and tokens signed by
its keys (RS256 or ES256), for serve_app/identity/jwt_auth.py's tests."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

ISSUER, AUDIENCE = "https://idp.example.com/", "llm-gateway"


class Jwks:
    """A JWKS endpoint whose keys the test changes; counts its fetches."""

    def __init__(self):
        self.keys: dict[str, object] = {}  # kid -> private key
        self.fetches = 0
        self.down = False
        self.hang_s = 0.0  # how long each fetch waits before it answers (a provider that does not answer)
        jwks = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                jwks.fetches += 1
                time.sleep(jwks.hang_s)
                if jwks.down:
                    self.send_error(503)
                    return
                body = json.dumps({"keys": [jwks.public(kid) for kid in jwks.keys]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/jwks.json"

    def add(self, kid: str, kind: str = "rsa"):
        self.keys[kid] = (
            rsa.generate_private_key(public_exponent=65537, key_size=2048)
            if kind == "rsa"
            else ec.generate_private_key(ec.SECP256R1())
        )
        return self.keys[kid]

    def public(self, kid: str) -> dict:
        key = self.keys[kid].public_key()
        jwk = json.loads(RSAAlgorithm.to_jwk(key) if isinstance(key, rsa.RSAPublicKey) else ECAlgorithm.to_jwk(key))
        return {**jwk, "kid": kid, "use": "sig"}

    def token(self, kid: str, key=None, alg: str | None = None, **claims) -> str:
        key = key or self.keys[kid]
        alg = alg or ("RS256" if isinstance(key, rsa.RSAPrivateKey) else "ES256")
        now = int(time.time())
        body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "iat": now, "exp": now + 300, **claims}
        return jwt.encode(
            {k: v for k, v in body.items() if v is not None}, key, algorithm=alg, headers={"kid": kid} if kid else None
        )

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
