"""One two-process script on NIXL's agent API, run unchanged against the
real ``nixl._api`` or ``ferry.nixl`` (``impl``): a target and an
initiator in two processes, host memory, every call serving stacks make.
Each side returns a log of (call, result) with results made comparable
(type names, states, exception class names, digests of the bytes that
landed); test_nixl_ab.py compares the two runs."""

import hashlib
import time

import numpy as np

BLOCK = 4096
COUNT = 64


def api(impl):
    if impl == "ferry":
        import ferry.nixl as m
    else:
        import nixl._api as m
    return m


def _err(f):
    try:
        f()
        return "ok"
    except Exception as e:  # the class name is what is compared
        return type(e).__name__


def _wait(agent, h, log, what):
    state = agent.transfer(h)
    log.append((what + ".transfer", state in ("DONE", "PROC")))
    for _ in range(100000):
        state = agent.check_xfer_state(h)
        if state != "PROC":
            break
        time.sleep(0.001)
    log.append((what + ".state", state))


def _notifs(agent, peer, want, log, what):
    got = []
    for _ in range(20000):
        got += agent.get_new_notifs().get(peer, [])
        if len(got) >= want:
            break
        time.sleep(0.001)
    log.append((what, sorted(got)))


def target(impl, inbox, outbox):
    m = api(impl)
    log = []
    agent = m.nixl_agent("target", m.nixl_agent_config(backends=["UCX"]))
    dst = np.zeros(COUNT * BLOCK, dtype=np.uint8)
    extra = np.zeros(BLOCK, dtype=np.uint8)
    reg = agent.get_reg_descs([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    log.append(("get_reg_descs", (type(reg).__name__, reg.descCount(), reg[0][:3] == (dst.ctypes.data, dst.nbytes, 0))))
    log.append(("register_memory", type(agent.register_memory(reg)).__name__))
    reg2 = agent.register_memory(np.array([[extra.ctypes.data, extra.nbytes, 0]], dtype=np.uint64), "DRAM")
    log.append(("register_memory(ndarray)", reg2.descCount()))
    log.append(("get_reg_descs(3-tuples)", agent.get_reg_descs([(1, 2, 0)], "DRAM")))
    blocks = [(dst.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(COUNT)]
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", blocks, "DRAM")
    md = agent.get_agent_metadata()
    log.append(("get_agent_metadata", type(md).__name__))
    outbox.put((md, dst.ctypes.data, extra.ctypes.data))
    peer_md = inbox.get()
    log.append(("add_remote_agent", agent.add_remote_agent(peer_md)))
    _notifs(agent, "initiator", 4, log, "get_new_notifs")
    log.append(("dst", hashlib.sha256(dst.tobytes()).hexdigest()))
    log.append(("extra", hashlib.sha256(extra.tobytes()).hexdigest()))
    agent.send_notif("initiator", b"ack")
    inbox.get()  # the initiator is done reading
    agent.release_dlist_handle(local)
    log.append(("deregister_memory", _err(lambda: agent.deregister_memory(reg))))
    outbox.put(log)


def initiator(impl, inbox, outbox):
    m = api(impl)
    log = []
    agent = m.nixl_agent("initiator", m.nixl_agent_config(backends=["UCX"]))
    src = (np.arange(COUNT * BLOCK) * 7 % 251).astype(np.uint8)
    back = np.zeros_like(src)
    agent.register_memory([(src.ctypes.data, src.nbytes, 0, ""), (back.ctypes.data, back.nbytes, 0, "")], "DRAM")
    md, dst_addr, extra_addr = inbox.get()
    outbox.put(agent.get_agent_metadata())
    log.append(("add_remote_agent", agent.add_remote_agent(md)))
    log.append(("add_remote_agent(garbage)", _err(lambda: agent.add_remote_agent(b"garbage"))))
    lblocks = np.array([(src.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(COUNT)], dtype=np.uint64)
    bblocks = [(back.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(COUNT)]
    rblocks = [(dst_addr + i * BLOCK, BLOCK, 0) for i in range(COUNT)]
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", lblocks, "DRAM")
    bh = agent.prep_xfer_dlist("", agent.get_xfer_descs(bblocks, "DRAM"))
    rh = agent.prep_xfer_dlist("target", rblocks, "DRAM")
    log.append(("prep_xfer_dlist", type(rh).__name__))
    # Write blocks 0..COUNT-1 reversed into the target, with a notification.
    li = np.arange(COUNT, dtype=np.int64)
    ri = li[::-1].copy()
    h = agent.make_prepped_xfer("WRITE", lh, li, rh, ri, b"written")
    log.append(("make_prepped_xfer", type(h).__name__))
    _wait(agent, h, log, "write")
    log.append(("transfer(again)", _wait(agent, h, log, "write2")))  # a request posts again
    agent.release_xfer_handle(h)
    # Read half of them back, by list of ints.
    h = agent.make_prepped_xfer("READ", bh, list(range(0, COUNT, 2)), rh, list(range(0, COUNT, 2)))
    _wait(agent, h, log, "read")
    log.append(("read bytes", hashlib.sha256(back[: BLOCK].tobytes()).hexdigest() == hashlib.sha256(src[(COUNT - 1) * BLOCK:].tobytes()).hexdigest()))
    log.append(("read untouched", bool((back[BLOCK:2 * BLOCK] == 0).all())))
    agent.release_xfer_handle(h)
    # initialize_xfer from descriptor lists (N x 3 arrays), with a message.
    ld = agent.get_xfer_descs(np.array([[src.ctypes.data, BLOCK, 0]], dtype=np.uint64), "DRAM")
    rd = agent.get_xfer_descs(np.array([[extra_addr, BLOCK, 0]], dtype=np.uint64), "DRAM")
    h = agent.initialize_xfer("WRITE", ld, rd, "target", b"init")
    _wait(agent, h, log, "initialize_xfer")
    agent.release_xfer_handle(h)
    agent.send_notif("target", b"standalone")
    # Errors.
    log.append(("index out of range", _err(lambda: agent.make_prepped_xfer("WRITE", lh, [COUNT], rh, [0]))))
    log.append(("sides swapped", _err(lambda: agent.make_prepped_xfer("WRITE", rh, [0], lh, [0]))))
    log.append(("bad op", _err(lambda: agent.make_prepped_xfer("COPY", lh, [0], rh, [0]))))
    log.append(("unknown backend", _err(lambda: agent.make_prepped_xfer("WRITE", lh, [0], rh, [0], backends=["NOPE"]))))
    log.append(("get_xfer_descs(no mem type)", agent.get_xfer_descs([(1, 2, 0)])))
    _notifs(agent, "target", 1, log, "get_new_notifs")
    outbox.put("done")
    agent.release_dlist_handle(lh)
    agent.release_dlist_handle(bh)
    agent.release_dlist_handle(rh)
    agent.remove_remote_agent("target")
    log.append(("prep after remove", _err(lambda: agent.prep_xfer_dlist("target", rblocks, "DRAM"))))
    outbox.put(log)
