"""A gRPC echo server for ebb's tests, with grpcio and no generated code: methods take and give
raw bytes. `/echo.Echo/Say` answers its request upper-cased; `/echo.Echo/Chat` streams each
message back upper-cased as it comes. It listens on 127.0.0.1:$PORT, after `--startup-delay-ms`
(a slow start, for waking from zero), and serves until it is stopped."""

import argparse
import os
import time
from concurrent import futures

import grpc


def say(request, context):
    context.set_trailing_metadata((("x-echo", "said"),))
    return request.upper()


def chat(requests, context):
    for message in requests:
        yield message.upper()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--startup-delay-ms", type=int, default=0)
    args = parser.parse_args()
    time.sleep(args.startup_delay_ms / 1000)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    handlers = {
        "Say": grpc.unary_unary_rpc_method_handler(say),
        "Chat": grpc.stream_stream_rpc_method_handler(chat),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("echo.Echo", handlers),))
    server.add_insecure_port(f"127.0.0.1:{os.environ['PORT']}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    main()
