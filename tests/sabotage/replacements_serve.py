"""The sabotage table's switches of the servers and layout.py (``tests/sabotage/switches.py``; the shared helpers
are in ``replacements.py``): each function takes the original of a row's target and returns its sabotaged
replacement; its docstring says what the switch turns off. Replacements import what they need when called: this file
is imported at interpreter start-up."""

from __future__ import annotations


def gate_without_load(orig):
    """VersionGate.enter (the server's version gate) never loads a checkpoint: it records the requested version and
    answers with the weights the server holds (its start weights)."""

    async def enter(self, version, load):
        async def nothing():
            return None

        return await orig(self, version, nothing)

    return enter


def each_process_alone(orig):
    """RolloutWorker's ``agree`` (every process must be able to push before any pushes into the shared servers) is
    replaced by this process's own decision."""

    def init(self, *args, **kwargs):
        kwargs["agree"] = lambda ok: ok
        orig(self, *args, **kwargs)

    return init


def push_start_weights(orig):
    """PolicySource (the weights a push sends) yields, at every push, the weights of its first push (the start
    policy): the transfer runs as before, with stale tensors."""

    def iterate(self):
        if not hasattr(self, "_first"):
            self._first = [(name, t.detach().clone()) for name, t in orig(self)]
        return iter(self._first)

    return iterate


def single_attempt(orig):
    """retrying (the client's retry) sends each request once: a transient error (connection refused, 502/503/504)
    fails at once, with or without a restarted server to wait for."""

    def retrying(send, recover=None):
        return send()

    return retrying


def checks_left_to_the_trainer(orig):
    """check_trainer_plan (layout.py's run of train.py's checks before any server starts) does nothing: the trainer
    checks its plan itself, after the servers have started."""

    def check(layout):
        return None

    return check


def vllm_default_shares(orig):
    """gpu_shares gives every server vLLM's own default share (0.92), whatever else runs on its GPUs, and refuses
    nothing."""

    def shares(servers, given):
        return [given or 0.92 for _ in servers]

    return shares


def rows_round_robin(orig):
    """replica_of sends row i to replica (i + offset) mod R: a group's rows are split over the replicas."""

    def replica_of(rows, replicas, offset=0):
        return [(i + offset) % replicas for i in range(len(rows))]

    return replica_of


def server_not_a_teacher(orig):
    """has_teacher does not count a teacher server (--teacher_server_url) as the run's teacher."""

    def has_teacher(cfg, adapters):
        return bool(cfg.teacher_model) or adapters or cfg.dual_lora or cfg.beta > 0

    return has_teacher


def agreement_by_any_process(orig):
    """OffPolicy._every_process (the trainer processes' agreement before a push into the shared servers) reduces with
    MAX instead of MIN: a version is pushed when any process may push it (the all-reduce still runs on every
    process; one process alone is unchanged)."""

    def _every_process(self, ok):
        return not orig(self, not ok)  # MIN over the negations: the negation of the MAX

    return _every_process


def keys_not_checked(orig):
    """authorized (the version gate's API-key check) accepts every request: the gate's routes run without a key
    (vLLM's own check comes after them, or never for the routes the gate answers itself)."""

    def authorized(header, keys):
        return True

    return authorized


def not_confined(orig):
    """inside (the gate's confinement of checkpoints to TRL_EXT_WEIGHTS_DIR) says yes to every directory: the gate
    loads any directory on the host a request names."""

    def inside(directory, root):
        return True

    return inside


def takes_every_push(orig):
    """takes_pushes says yes to every server: the push routes of a server started without --weight-transfer-config
    reach the gate and the engine."""

    def takes_pushes(engine):
        return True

    return takes_pushes


def open_push_kept(orig):
    """VersionGate.abandon_push does nothing: a push a killed trainer left open (start, no finish) keeps the gate
    held after the next trainer's init."""

    async def abandon_push(self):
        return None

    return abandon_push


def never_restart_servers(orig):
    """server_restartable (layout.py's watcher: is a server that exited started again?) answers no: a server that
    dies during training stops the run, as before restarts existed."""

    def server_restartable(server, limit):
        return False

    return server_restartable


def never_restart_the_trainer(orig):
    """trainer_refusal (layout.py's watcher: why a trainer's exit is not restarted) always refuses: a crashed trainer
    stops the run, as before restarts existed."""

    def trainer_refusal(code, run_dir, started, restarts, limit):
        return "restarts switched off"

    return trainer_refusal


def restart_every_trainer_exit(orig):
    """trainer_refusal (layout.py's watcher) takes every non-zero exit for a crash: exit 2 and a run_summary.json
    saying config_error or numeric_fault are restarted too (the bound and the checkpoint are still checked)."""

    def trainer_refusal(code, run_dir, started, restarts, limit):
        return orig(1, run_dir, float("inf"), restarts, limit)

    return trainer_refusal


def no_wait_for_a_restart(orig):
    """Replica.recover (a request's wait for a server layout.py restarts) gives up at once: the request fails as
    if the server had no restart coming."""

    def recover(self, failure):
        raise failure.error from failure

    return recover


def version_by_number(orig):
    """VersionGate.serves (is the requested version loaded?) compares version numbers only: a restarted trainer's
    version N, published under a new directory, is answered with the weights the dead trainer's N left loaded."""

    def serves(self, version, source=None):
        return self.version == version

    return serves
