"""The Conductor's gRPC face (protos/conductor.proto): messages in and out of a ConductorService, its errors as
status codes (Mismatch -> FAILED_PRECONDITION, ValueError -> INVALID_ARGUMENT, KeyError -> NOT_FOUND; a standby
answers UNAVAILABLE), the operator's calls checked (conductor.auth), and the server that serves it."""

from __future__ import annotations

import functools
import time
from concurrent import futures

import grpc

from conductor.auth import OperatorCheck, new_instance_token, same_token
from conductor.quotes import PARTS
from conductor.service import HEARTBEAT_INTERVAL_FRACTION, ConductorService, Mismatch
from conductor.types import Decision, Instance, InstanceState, KeyChain, Load, Role, ScheduleRequest, Wait
from mooncake import tls
from mooncake.faults import StatusTable
from mooncake.runtime.channels import SERVER_OPTIONS
from mooncake.serving.reports import InFlight
from protos import conductor_pb2 as pb
from protos import conductor_pb2_grpc as pb_grpc

ROLE_TO_PB = {Role.PREFILL: pb.PREFILL, Role.DECODE: pb.DECODE, Role.KVSTORE: pb.KVSTORE}
PB_TO_ROLE = {v: k for k, v in ROLE_TO_PB.items()}
STATE_TO_PB = {
    InstanceState.ALIVE: pb.ALIVE,
    InstanceState.DRAINING: pb.DRAINING,
    InstanceState.DEAD: pb.DEAD,
    InstanceState.SUSPECT: pb.SUSPECT,
}
CONDUCTOR_STATUS = StatusTable(
    raised=[
        (Mismatch, grpc.StatusCode.FAILED_PRECONDITION),  # a worker whose KV the cluster cannot use: it stops trying
        (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
        (KeyError, grpc.StatusCode.NOT_FOUND),
    ]
)


def _status(fn):
    """Answer through CONDUCTOR_STATUS; a standby answers everything UNAVAILABLE (callers move to the next
    Conductor)."""
    answered = CONDUCTOR_STATUS.servicer(fn)

    @functools.wraps(fn)
    def wrapper(self, request, context):
        if not self.service.leading.is_set():
            context.abort(
                grpc.StatusCode.UNAVAILABLE, "this Conductor is a standby: another one holds the leader lease"
            )
        return answered(self, request, context)

    return wrapper


def load_from_pb(msg: pb.Load) -> Load:
    return Load(
        msg.queued_requests,
        msg.queued_s,
        msg.running_requests,
        msg.context_tokens,
        msg.free_kv_blocks,
        msg.step_s,
        msg.batch_cap,
        msg.landing_blocks,
        msg.received_requests,
        msg.step_batch,
        msg.step_context_tokens,
        msg.queued_tokens,
        msg.running_blocks,
        msg.landing_held_blocks,
        tuple(InFlight(p.prompt_tokens, p.computed_tokens) for p in msg.prompts),
        msg.waiting_requests,
        msg.waiting_s,
    )


def load_to_pb(load: Load) -> pb.Load:
    return pb.Load(
        queued_requests=load.queued_requests,
        queued_s=load.queued_s,
        running_requests=load.running_requests,
        context_tokens=load.context_tokens,
        free_kv_blocks=load.free_kv_blocks,
        step_s=load.step_s,
        batch_cap=load.batch_cap,
        landing_blocks=load.landing_blocks,
        received_requests=load.received_requests,
        step_batch=load.step_batch,
        step_context_tokens=load.step_context_tokens,
        queued_tokens=load.queued_tokens,
        running_blocks=load.running_blocks,
        landing_held_blocks=load.landing_held_blocks,
        prompts=[
            pb.InFlightPrompt(prompt_tokens=p.prompt_tokens, computed_tokens=p.computed_tokens) for p in load.prompts
        ],
        waiting_requests=load.waiting_requests,
        waiting_s=load.waiting_s,
    )


class ConductorServicer(pb_grpc.ConductorServicer):
    """The gRPC face of a ConductorService; ``operator``: who may make the admin calls (conductor.auth)."""

    def __init__(self, service: ConductorService, operator: OperatorCheck | None = None) -> None:
        self.service = service
        self.operator = operator or OperatorCheck(None)

    @_status
    def Register(self, request, context):
        if request.role not in PB_TO_ROLE:
            raise ValueError("role must be PREFILL, DECODE or KVSTORE")
        if not request.node:
            raise ValueError("node is required: the kvstore node this instance uses (a kvstore node: its own name)")
        inst = Instance(
            request.id,
            PB_TO_ROLE[request.role],
            request.address,
            request.node,
            request.model,
            request.capacity,
            fingerprint=bytes(request.fingerprint),
            engine=request.engine,
            transport=request.transport,
            pipeline_stages=max(request.pipeline_stages, 1),
            pipeline_chunk=request.pipeline_chunk,
            step_tokens=request.step_tokens,
            block_bytes=request.block_bytes,
            kv_blocks=request.kv_blocks,
            kv_shared=request.kv_shared,
            tensor_parallel_size=max(request.tensor_parallel_size, 1),
            block_size=request.block_size,
            kv_dtype=request.kv_dtype,
            pool_kv_dtype=request.pool_kv_dtype,
            token=new_instance_token(),
        )
        self.service.register(inst)  # Mismatch: FAILED_PRECONDITION (CONDUCTOR_STATUS)
        timeout = self.service.conductor.config.heartbeat_timeout_s
        return pb.RegisterResponse(
            heartbeat_interval_s=timeout * HEARTBEAT_INTERVAL_FRACTION,
            heartbeat_timeout_s=timeout,
            instance_token=inst.token,
        )

    @_status
    def Heartbeat(self, request, context):
        known, cap = self.service.heartbeat(request.id, load_from_pb(request.load))
        return pb.HeartbeatResponse(known=known, batch_cap=cap)

    @_status
    def Report(self, request, context):
        self.service.report(request)
        return pb.ReportResponse()

    @_status
    def Schedule(self, request, context):
        if request.probe:
            return pb.ScheduleResponse(shed_s=self.service.shed_s())
        if request.key_chain and request.keys:
            raise ValueError("send the block keys as keys or as key_chain, not both")
        keys = KeyChain(request.key_chain) if request.key_chain else [bytes(k) for k in request.keys]
        req = ScheduleRequest(
            request.request_id,
            keys,
            request.prompt_tokens,
            request.block_tokens,
            request.expected_output_tokens,
            request.slo_class or "default",
            tuple(request.failed),
            priority=request.priority,
            tenant=request.tenant,
            tenant_weight=request.tenant_weight or 1.0,
            waited_s=request.waited_s,
            retry=request.retry,
            follows=request.follows,
            ttft_slo_s=request.ttft_slo_s,
            tbt_slo_s=request.tbt_slo_s,
        )
        outcome, info = self.service.schedule(req)
        p = outcome.predicted
        predicted = (
            None
            if p is None
            else pb.Prediction(
                ttft_s=p.ttft_s, tbt_s=p.tbt_s, queue_s=p.queue_s, transfer_s=p.transfer_s, prefill_s=p.prefill_s
            )
        )
        if isinstance(outcome, Wait):
            return pb.ScheduleResponse(wait_s=outcome.wait_s, predicted=predicted)
        if not isinstance(outcome, Decision):
            rejection = pb.Rejection(
                reason=outcome.reason.value,
                message=outcome.message,
                retry_after_s=outcome.retry_after_s,
                offer_slo_class=outcome.offer_slo_class,
            )
            return pb.ScheduleResponse(rejection=rejection, predicted=predicted, shed_s=outcome.shed_s)
        prefill_address, decode_address, fetch_address, prefill_node, prefill_node_address = info
        plan = outcome.plan
        return pb.ScheduleResponse(
            placement=pb.Placement(
                prefill_id=outcome.prefill,
                prefill_address=prefill_address,
                prefill_node=prefill_node,
                prefill_node_address=prefill_node_address,
                decode_id=outcome.decode,
                decode_address=decode_address,
                policy=outcome.policy,
                local_prefill=outcome.local,
                local_chunk_tokens=outcome.chunk_tokens,
                admit_at_decode=outcome.admit_at_decode,
                ahead=outcome.ahead,
                narrow_handoff=outcome.narrow,
                plan=pb.PrefixPlan(
                    local_blocks=plan.local_blocks,
                    fetch_node=plan.fetch_node or "",
                    fetch_address=fetch_address,
                    fetch_blocks=plan.fetch_blocks,
                    compute_tokens=plan.compute_tokens,
                    keep_fetched=plan.keep_fetched,
                ),
            ),
            predicted=predicted,
        )

    @_status
    def AdmitAtDecode(self, request, context):
        rejection = self.service.admit_at_decode(request.decode_id, max(0, request.context_tokens))
        if rejection is None:
            return pb.AdmitAtDecodeResponse(admit=True)
        return pb.AdmitAtDecodeResponse(
            admit=False,
            rejection=pb.Rejection(
                reason=rejection.reason.value, message=rejection.message, retry_after_s=rejection.retry_after_s
            ),
        )

    @_status
    def ListInstances(self, request, context):
        role = PB_TO_ROLE.get(request.role)
        rows = self.service.snapshot_instances(role)
        c = self.service.conductor
        infos = []
        for i, age, blocks, dram, served, retiring, (in_prefill, decoding, landing, kv_held) in rows:
            info = pb.InstanceInfo(
                id=i.id,
                role=ROLE_TO_PB[i.role],
                address=i.address,
                node=i.node,
                model=i.model,
                capacity=i.capacity,
                state=STATE_TO_PB[i.state],
                heartbeat_age_s=age,
                load=load_to_pb(i.load),
                indexed_blocks=blocks,
                dram_blocks=dram,
                retiring=retiring,
                engine=i.engine,
                pipeline_stages=i.pipeline_stages,
                pipeline_chunk=i.pipeline_chunk,
                placed_in_prefill=in_prefill,
                placed_decoding=decoding,
                landing_held=landing,
                transport=i.transport,
                kv_blocks=i.kv_blocks,
                kv_held=kv_held,
                tensor_parallel_size=i.tensor_parallel_size,
                block_size=i.block_size,
                kv_dtype=i.kv_dtype,
                pool_kv_dtype=i.pool_kv_dtype,
            )
            if served is not None:
                info.decisions, info.prompt_blocks = served.decisions, served.prompt_blocks
                info.reused_blocks, info.fetched_blocks = served.reused_blocks, served.fetched_blocks
            infos.append(info)
        return pb.ListInstancesResponse(
            instances=infos,
            policy=c.policy.kind.value,
            admission=c.admission.value,
            index_blocks=c.index.num_blocks,
            scheduled=c.counters.scheduled,
            rejected=c.counters.rejected,
            control_port=self.service.control_port,
            admin_open=self.operator.open,
            insecure=tls.identity() is None,
            plan=self._plan_pb(self.service.planning.last),
            quote_held={part: c.quotes.held(part)[0] for part in PARTS},
            quotes_measured={part: c.quotes.held(part)[1] for part in PARTS},
        )

    def _plan_pb(self, plan) -> pb.PlanResponse:
        loop = self.service.planning
        out = pb.PlanResponse(acting=loop.acting, interval_s=loop.config.interval_s)
        if plan is not None:
            out.prefill, out.decode, out.forecast_rate = plan.prefill, plan.decode, plan.rate
            out.age_s, out.reasoning = max(0.0, time.monotonic() - plan.at), plan.describe()
        return out

    @_status
    def Plan(self, request, context):
        """The planner's last plan, or (``now``) one made now on a copy of it: asking changes nothing."""
        return self._plan_pb(self.service.planning.plan_now() if request.now else self.service.planning.last)

    @_status
    def Drain(self, request, context):
        self.operator.require(context, "Drain")
        return pb.DrainResponse(state=STATE_TO_PB[self.service.drain(request.id, request.remove)])

    @_status
    def ScalePool(self, request, context):
        self.operator.require(context, "ScalePool")
        if request.role not in (pb.PREFILL, pb.DECODE):
            raise ValueError("role must be PREFILL or DECODE (pool nodes scale with their prefill workers)")
        try:
            alive, started, draining = self.service.scale(PB_TO_ROLE[request.role], request.replicas)
        except RuntimeError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.ScalePoolResponse(
            provider=self.service.provider.kind, alive=alive, started=started, draining=draining
        )

    @_status
    def Deregister(self, request, context):
        inst = self.service.conductor.instances.get(request.id)
        if not (inst is not None and same_token(bytes(request.instance_token), inst.token)):
            self.operator.require(context, f"Deregister of {request.id} without its instance token")
        if request.hand_off and inst is not None and inst.role is Role.KVSTORE:
            self.service.hand_off(inst.node, max(0.0, (context.time_remaining() or 60.0) - 1.0), stopping=True)
        self.service.deregister(request.id)
        return pb.DeregisterResponse()

    @_status
    def SetPolicy(self, request, context):
        self.operator.require(context, "SetPolicy")
        policy, admission = self.service.set_policy(request.policy, request.admission)
        return pb.SetPolicyResponse(policy=policy, admission=admission)


def start_server(
    service: ConductorService,
    host: str = "127.0.0.1",
    port: int = 0,
    workers: int = 16,
    operator_token: str | None = None,
) -> tuple[grpc.Server, int]:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="conductor-rpc"), options=SERVER_OPTIONS
    )
    pb_grpc.add_ConductorServicer_to_server(ConductorServicer(service, OperatorCheck(operator_token)), server)
    bound = tls.grpc_add_port(server, f"{host}:{port}")
    if bound == 0:
        raise ValueError(f"cannot bind the Conductor's gRPC service to {host}:{port}")
    server.start()
    return server, bound
