"""A gRPC client for ebb's tests: calls the echo server through ebb's proxy, the route chosen by
the channel's authority. Prints one JSON line of what happened, exits 0 unless the call broke in
a way the test did not ask for.

  echo_client.py PROXY AUTHORITY unary TEXT [--deadline-s S] [--tls-ca PEM]
  echo_client.py PROXY AUTHORITY chat N [--pause-ms MS] [--tls-ca PEM]

With --tls-ca, the channel is TLS (h2 by ALPN), trusting that certificate for the authority.
"""

import argparse
import json
import time

import grpc


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("proxy")
    parser.add_argument("authority")
    parser.add_argument("kind", choices=["unary", "chat"])
    parser.add_argument("arg")
    parser.add_argument("--deadline-s", type=float, default=60)
    parser.add_argument("--pause-ms", type=int, default=0)
    parser.add_argument("--tls-ca")
    args = parser.parse_args()
    options = (("grpc.default_authority", args.authority),)
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        options += (("grpc.ssl_target_name_override", args.authority),)
        channel = grpc.secure_channel(args.proxy, credentials, options=options)
    else:
        channel = grpc.insecure_channel(args.proxy, options=options)
    started = time.monotonic()
    out = {}
    try:
        if args.kind == "unary":
            say = channel.unary_unary("/echo.Echo/Say")
            answer, call = say.with_call(args.arg.encode(), timeout=args.deadline_s)
            out = {
                "code": call.code().name,
                "answer": answer.decode(),
                "trailers": {k: v for k, v in call.trailing_metadata()},
            }
        else:
            chat = channel.stream_stream("/echo.Echo/Chat")

            def messages():
                for i in range(int(args.arg)):
                    if i and args.pause_ms:
                        time.sleep(args.pause_ms / 1000)
                    yield f"message {i}".encode()

            answers = []
            last_ms = 0
            for m in chat(messages(), timeout=args.deadline_s):
                answers.append(m.decode())
                last_ms = int(time.time() * 1000)
            out = {"code": "OK", "answers": answers, "last_answer_ms": last_ms}
    except grpc.RpcError as e:
        out = {"code": e.code().name, "details": e.details()}
    out["seconds"] = round(time.monotonic() - started, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
