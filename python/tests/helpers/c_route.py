"""The route of one request through Ferry's C API (libferry.so, by ctypes):

    python c_route.py LIBFERRY PREFER SEGMENT ADDR LEN

PREFER is "-" for none. Allocates LEN bytes of host memory with
ferry_allocate_memory, opens SEGMENT and prints ferry_route_json's JSON."""

import ctypes
import sys


def main():
    lib_path, prefer, segment, addr, length = sys.argv[1:6]
    lib = ctypes.CDLL(lib_path)
    lib.ferry_last_error.restype = ctypes.c_char_p

    def check(status, what):
        if status != 0:
            raise SystemExit(f"{what}: {status} {lib.ferry_last_error().decode()}")

    config = ctypes.c_void_p()
    check(lib.ferry_config_new(ctypes.byref(config)), "ferry_config_new")
    if prefer != "-":
        check(lib.ferry_config_set(config, b"prefer", prefer.encode()), "ferry_config_set prefer")
    engine = ctypes.c_void_p()
    check(lib.ferry_engine_new(config, ctypes.byref(engine)), "ferry_engine_new")
    local = ctypes.c_void_p()
    check(lib.ferry_allocate_memory(engine, ctypes.c_size_t(int(length)), ctypes.c_int32(-1), ctypes.byref(local)),
          "ferry_allocate_memory")
    seg = ctypes.c_uint64()
    check(lib.ferry_open_segment(engine, segment.encode(), ctypes.byref(seg)), "ferry_open_segment")
    buf = ctypes.create_string_buffer(1 << 16)
    out_len = ctypes.c_size_t()
    check(lib.ferry_route_json(engine, seg, local, ctypes.c_uint64(int(addr)), ctypes.c_uint64(int(length)),
                               buf, ctypes.c_size_t(len(buf)), ctypes.byref(out_len)), "ferry_route_json")
    print(buf.value.decode(), flush=True)
    lib.ferry_free_memory(engine, local)
    lib.ferry_engine_free(engine)
    lib.ferry_config_free(config)


if __name__ == "__main__":
    main()
