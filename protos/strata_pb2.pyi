from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    PENDING: _ClassVar[JobState]
    SCHEDULED: _ClassVar[JobState]
    RUNNING: _ClassVar[JobState]
    SUCCEEDED: _ClassVar[JobState]
    FAILED: _ClassVar[JobState]
    CANCELLED: _ClassVar[JobState]
    RESTARTING: _ClassVar[JobState]

class TaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATE_UNSPECIFIED: _ClassVar[TaskState]
    TASK_PENDING: _ClassVar[TaskState]
    TASK_STARTING: _ClassVar[TaskState]
    TASK_RUNNING: _ClassVar[TaskState]
    TASK_SUCCEEDED: _ClassVar[TaskState]
    TASK_FAILED: _ClassVar[TaskState]
    TASK_CANCELLED: _ClassVar[TaskState]

class FailureKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_NONE: _ClassVar[FailureKind]
    FAILURE_EXIT_CODE: _ClassVar[FailureKind]
    FAILURE_OOM: _ClassVar[FailureKind]
    FAILURE_SIGNAL: _ClassVar[FailureKind]
    FAILURE_LAUNCH: _ClassVar[FailureKind]
    FAILURE_LOST: _ClassVar[FailureKind]
    FAILURE_BAD_CONFIG: _ClassVar[FailureKind]
    FAILURE_USER_CODE: _ClassVar[FailureKind]
    FAILURE_COLLECTIVE_TIMEOUT: _ClassVar[FailureKind]
    FAILURE_CANCELLED: _ClassVar[FailureKind]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    READY: _ClassVar[WorkerState]
    BUSY: _ClassVar[WorkerState]
    LOST: _ClassVar[WorkerState]
    DRAINING: _ClassVar[WorkerState]
JOB_STATE_UNSPECIFIED: JobState
PENDING: JobState
SCHEDULED: JobState
RUNNING: JobState
SUCCEEDED: JobState
FAILED: JobState
CANCELLED: JobState
RESTARTING: JobState
TASK_STATE_UNSPECIFIED: TaskState
TASK_PENDING: TaskState
TASK_STARTING: TaskState
TASK_RUNNING: TaskState
TASK_SUCCEEDED: TaskState
TASK_FAILED: TaskState
TASK_CANCELLED: TaskState
FAILURE_NONE: FailureKind
FAILURE_EXIT_CODE: FailureKind
FAILURE_OOM: FailureKind
FAILURE_SIGNAL: FailureKind
FAILURE_LAUNCH: FailureKind
FAILURE_LOST: FailureKind
FAILURE_BAD_CONFIG: FailureKind
FAILURE_USER_CODE: FailureKind
FAILURE_COLLECTIVE_TIMEOUT: FailureKind
FAILURE_CANCELLED: FailureKind
WORKER_STATE_UNSPECIFIED: WorkerState
READY: WorkerState
BUSY: WorkerState
LOST: WorkerState
DRAINING: WorkerState

class BuiltinModel(_message.Message):
    __slots__ = ("kind", "input_shape", "hidden", "classes", "no_hidden")
    KIND_FIELD_NUMBER: _ClassVar[int]
    INPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    NO_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    kind: str
    input_shape: _containers.RepeatedScalarFieldContainer[int]
    hidden: _containers.RepeatedScalarFieldContainer[int]
    classes: int
    no_hidden: bool
    def __init__(self, kind: _Optional[str] = ..., input_shape: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Iterable[int]] = ..., classes: _Optional[int] = ..., no_hidden: _Optional[bool] = ...) -> None: ...

class KerasFile(_message.Message):
    __slots__ = ("name", "sha256", "size", "config")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    name: str
    sha256: str
    size: int
    config: str
    def __init__(self, name: _Optional[str] = ..., sha256: _Optional[str] = ..., size: _Optional[int] = ..., config: _Optional[str] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("keras_json", "builtin", "keras_file")
    KERAS_JSON_FIELD_NUMBER: _ClassVar[int]
    BUILTIN_FIELD_NUMBER: _ClassVar[int]
    KERAS_FILE_FIELD_NUMBER: _ClassVar[int]
    keras_json: str
    builtin: BuiltinModel
    keras_file: KerasFile
    def __init__(self, keras_json: _Optional[str] = ..., builtin: _Optional[_Union[BuiltinModel, _Mapping]] = ..., keras_file: _Optional[_Union[KerasFile, _Mapping]] = ...) -> None: ...

class FeatureSpec(_message.Message):
    __slots__ = ("shape", "dtype")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class DataSpec(_message.Message):
    __slots__ = ("source", "path", "batch_size", "examples", "test_path", "features", "label", "image_size", "test_fraction")
    class FeaturesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: FeatureSpec
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[FeatureSpec, _Mapping]] = ...) -> None: ...
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    TEST_PATH_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TEST_FRACTION_FIELD_NUMBER: _ClassVar[int]
    source: str
    path: str
    batch_size: int
    examples: int
    test_path: str
    features: _containers.MessageMap[str, FeatureSpec]
    label: str
    image_size: _containers.RepeatedScalarFieldContainer[int]
    test_fraction: float
    def __init__(self, source: _Optional[str] = ..., path: _Optional[str] = ..., batch_size: _Optional[int] = ..., examples: _Optional[int] = ..., test_path: _Optional[str] = ..., features: _Optional[_Mapping[str, FeatureSpec]] = ..., label: _Optional[str] = ..., image_size: _Optional[_Iterable[int]] = ..., test_fraction: _Optional[float] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "learning_rate")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    learning_rate: float
    def __init__(self, name: _Optional[str] = ..., learning_rate: _Optional[float] = ...) -> None: ...

class TrainingSpec(_message.Message):
    __slots__ = ("epochs", "steps", "optimizer", "loss", "seed", "time_limit")
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_FIELD_NUMBER: _ClassVar[int]
    epochs: int
    steps: int
    optimizer: OptimizerSpec
    loss: str
    seed: int
    time_limit: float
    def __init__(self, epochs: _Optional[int] = ..., steps: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., loss: _Optional[str] = ..., seed: _Optional[int] = ..., time_limit: _Optional[float] = ...) -> None: ...

class MemorySpec(_message.Message):
    __slots__ = ("per_task_budget", "mixed_precision", "recompute", "profile")
    PER_TASK_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MIXED_PRECISION_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    per_task_budget: str
    mixed_precision: str
    recompute: bool
    profile: str
    def __init__(self, per_task_budget: _Optional[str] = ..., mixed_precision: _Optional[str] = ..., recompute: _Optional[bool] = ..., profile: _Optional[str] = ...) -> None: ...

class GradientSpec(_message.Message):
    __slots__ = ("accumulate", "compression", "pack_size")
    ACCUMULATE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    PACK_SIZE_FIELD_NUMBER: _ClassVar[int]
    accumulate: int
    compression: str
    pack_size: str
    def __init__(self, accumulate: _Optional[int] = ..., compression: _Optional[str] = ..., pack_size: _Optional[str] = ...) -> None: ...

class CodeSpec(_message.Message):
    __slots__ = ("dir_name", "sha256", "size", "model", "dataset")
    DIR_NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dir_name: str
    sha256: str
    size: int
    model: str
    dataset: str
    def __init__(self, dir_name: _Optional[str] = ..., sha256: _Optional[str] = ..., size: _Optional[int] = ..., model: _Optional[str] = ..., dataset: _Optional[str] = ...) -> None: ...

class CheckpointSpec(_message.Message):
    __slots__ = ("every_steps", "keep")
    EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    every_steps: int
    keep: int
    def __init__(self, every_steps: _Optional[int] = ..., keep: _Optional[int] = ...) -> None: ...

class RestartSpec(_message.Message):
    __slots__ = ("max_restarts", "backoff_s", "retry_user_errors")
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_S_FIELD_NUMBER: _ClassVar[int]
    RETRY_USER_ERRORS_FIELD_NUMBER: _ClassVar[int]
    max_restarts: int
    backoff_s: float
    retry_user_errors: bool
    def __init__(self, max_restarts: _Optional[int] = ..., backoff_s: _Optional[float] = ..., retry_user_errors: _Optional[bool] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("name", "strategy", "workers", "parameter_servers", "stages", "microbatches", "model", "data", "training", "memory", "checkpoint", "restart", "code", "gradients", "elastic", "queue", "priority", "preemptible")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_SERVERS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIBLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    strategy: str
    workers: int
    parameter_servers: int
    stages: int
    microbatches: int
    model: ModelSpec
    data: DataSpec
    training: TrainingSpec
    memory: MemorySpec
    checkpoint: CheckpointSpec
    restart: RestartSpec
    code: CodeSpec
    gradients: GradientSpec
    elastic: WorkerRange
    queue: str
    priority: str
    preemptible: bool
    def __init__(self, name: _Optional[str] = ..., strategy: _Optional[str] = ..., workers: _Optional[int] = ..., parameter_servers: _Optional[int] = ..., stages: _Optional[int] = ..., microbatches: _Optional[int] = ..., model: _Optional[_Union[ModelSpec, _Mapping]] = ..., data: _Optional[_Union[DataSpec, _Mapping]] = ..., training: _Optional[_Union[TrainingSpec, _Mapping]] = ..., memory: _Optional[_Union[MemorySpec, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointSpec, _Mapping]] = ..., restart: _Optional[_Union[RestartSpec, _Mapping]] = ..., code: _Optional[_Union[CodeSpec, _Mapping]] = ..., gradients: _Optional[_Union[GradientSpec, _Mapping]] = ..., elastic: _Optional[_Union[WorkerRange, _Mapping]] = ..., queue: _Optional[str] = ..., priority: _Optional[str] = ..., preemptible: _Optional[bool] = ...) -> None: ...

class WorkerRange(_message.Message):
    __slots__ = ("min", "max")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    min: int
    max: int
    def __init__(self, min: _Optional[int] = ..., max: _Optional[int] = ...) -> None: ...

class JobMetrics(_message.Message):
    __slots__ = ("step", "total_steps", "loss", "test_accuracy", "examples_per_sec", "test_loss", "has_test_accuracy", "test_metrics")
    class TestMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TEST_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_PER_SEC_FIELD_NUMBER: _ClassVar[int]
    TEST_LOSS_FIELD_NUMBER: _ClassVar[int]
    HAS_TEST_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    TEST_METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    total_steps: int
    loss: float
    test_accuracy: float
    examples_per_sec: float
    test_loss: float
    has_test_accuracy: bool
    test_metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., total_steps: _Optional[int] = ..., loss: _Optional[float] = ..., test_accuracy: _Optional[float] = ..., examples_per_sec: _Optional[float] = ..., test_loss: _Optional[float] = ..., has_test_accuracy: _Optional[bool] = ..., test_metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class TaskInfo(_message.Message):
    __slots__ = ("role", "index", "worker", "state", "stage", "memory_budget_bytes", "peak_memory_bytes", "in_use_bytes", "estimated_memory_bytes", "failure", "exit_code", "message", "address", "weights_sha256", "model_path", "replica", "layers", "replica_weights_sha256")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_USE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    role: str
    index: int
    worker: str
    state: TaskState
    stage: int
    memory_budget_bytes: int
    peak_memory_bytes: int
    in_use_bytes: int
    estimated_memory_bytes: int
    failure: FailureKind
    exit_code: int
    message: str
    address: str
    weights_sha256: str
    model_path: str
    replica: int
    layers: _containers.RepeatedScalarFieldContainer[str]
    replica_weights_sha256: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., index: _Optional[int] = ..., worker: _Optional[str] = ..., state: _Optional[_Union[TaskState, str]] = ..., stage: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ..., peak_memory_bytes: _Optional[int] = ..., in_use_bytes: _Optional[int] = ..., estimated_memory_bytes: _Optional[int] = ..., failure: _Optional[_Union[FailureKind, str]] = ..., exit_code: _Optional[int] = ..., message: _Optional[str] = ..., address: _Optional[str] = ..., weights_sha256: _Optional[str] = ..., model_path: _Optional[str] = ..., replica: _Optional[int] = ..., layers: _Optional[_Iterable[str]] = ..., replica_weights_sha256: _Optional[_Iterable[str]] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "name", "state", "strategy", "message", "restarts", "created_at", "finished_at", "metrics", "tasks", "spec", "estimated_memory_bytes", "started_at", "output_dir", "outputs", "checkpoint_step", "steps_repeated", "tensorboard_dir", "owner", "training", "probe_of", "resizes", "workers_now", "position", "estimated_start", "preemptions")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_REPEATED_FIELD_NUMBER: _ClassVar[int]
    TENSORBOARD_DIR_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    PROBE_OF_FIELD_NUMBER: _ClassVar[int]
    RESIZES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_NOW_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_START_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    state: JobState
    strategy: str
    message: str
    restarts: int
    created_at: float
    finished_at: float
    metrics: JobMetrics
    tasks: _containers.RepeatedCompositeFieldContainer[TaskInfo]
    spec: JobSpec
    estimated_memory_bytes: int
    started_at: float
    output_dir: str
    outputs: _containers.RepeatedScalarFieldContainer[str]
    checkpoint_step: int
    steps_repeated: int
    tensorboard_dir: str
    owner: str
    training: str
    probe_of: str
    resizes: int
    workers_now: int
    position: int
    estimated_start: float
    preemptions: int
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., strategy: _Optional[str] = ..., message: _Optional[str] = ..., restarts: _Optional[int] = ..., created_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., metrics: _Optional[_Union[JobMetrics, _Mapping]] = ..., tasks: _Optional[_Iterable[_Union[TaskInfo, _Mapping]]] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., estimated_memory_bytes: _Optional[int] = ..., started_at: _Optional[float] = ..., output_dir: _Optional[str] = ..., outputs: _Optional[_Iterable[str]] = ..., checkpoint_step: _Optional[int] = ..., steps_repeated: _Optional[int] = ..., tensorboard_dir: _Optional[str] = ..., owner: _Optional[str] = ..., training: _Optional[str] = ..., probe_of: _Optional[str] = ..., resizes: _Optional[int] = ..., workers_now: _Optional[int] = ..., position: _Optional[int] = ..., estimated_start: _Optional[float] = ..., preemptions: _Optional[int] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("seq", "time", "kind", "message", "job")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time: float
    kind: str
    message: str
    job: Job
    def __init__(self, seq: _Optional[int] = ..., time: _Optional[float] = ..., kind: _Optional[str] = ..., message: _Optional[str] = ..., job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class PlannedTask(_message.Message):
    __slots__ = ("role", "index", "worker", "stage", "layers", "estimated_memory_bytes", "memory_budget_bytes")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    role: str
    index: int
    worker: str
    stage: int
    layers: _containers.RepeatedScalarFieldContainer[str]
    estimated_memory_bytes: int
    memory_budget_bytes: int
    def __init__(self, role: _Optional[str] = ..., index: _Optional[int] = ..., worker: _Optional[str] = ..., stage: _Optional[int] = ..., layers: _Optional[_Iterable[str]] = ..., estimated_memory_bytes: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("strategy", "feasible", "reason", "tasks")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    FEASIBLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    feasible: bool
    reason: str
    tasks: _containers.RepeatedCompositeFieldContainer[PlannedTask]
    def __init__(self, strategy: _Optional[str] = ..., feasible: _Optional[bool] = ..., reason: _Optional[str] = ..., tasks: _Optional[_Iterable[_Union[PlannedTask, _Mapping]]] = ...) -> None: ...

class MemoryStatus(_message.Message):
    __slots__ = ("budget_bytes", "reserved_bytes", "in_use_bytes", "peak_bytes")
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_USE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    budget_bytes: int
    reserved_bytes: int
    in_use_bytes: int
    peak_bytes: int
    def __init__(self, budget_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., in_use_bytes: _Optional[int] = ..., peak_bytes: _Optional[int] = ...) -> None: ...

class WorkerTask(_message.Message):
    __slots__ = ("job_id", "role", "index", "state", "memory_budget_bytes", "in_use_bytes", "peak_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_USE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    role: str
    index: int
    state: TaskState
    memory_budget_bytes: int
    in_use_bytes: int
    peak_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., role: _Optional[str] = ..., index: _Optional[int] = ..., state: _Optional[_Union[TaskState, str]] = ..., memory_budget_bytes: _Optional[int] = ..., in_use_bytes: _Optional[int] = ..., peak_bytes: _Optional[int] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("name", "address", "state", "device", "memory", "tasks", "last_seen", "shared_dir", "data_roots", "disk", "cpu_kernels")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    SHARED_DIR_FIELD_NUMBER: _ClassVar[int]
    DATA_ROOTS_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    CPU_KERNELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    state: WorkerState
    device: str
    memory: MemoryStatus
    tasks: _containers.RepeatedCompositeFieldContainer[WorkerTask]
    last_seen: float
    shared_dir: str
    data_roots: _containers.RepeatedScalarFieldContainer[str]
    disk: DiskStatus
    cpu_kernels: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ..., device: _Optional[str] = ..., memory: _Optional[_Union[MemoryStatus, _Mapping]] = ..., tasks: _Optional[_Iterable[_Union[WorkerTask, _Mapping]]] = ..., last_seen: _Optional[float] = ..., shared_dir: _Optional[str] = ..., data_roots: _Optional[_Iterable[str]] = ..., disk: _Optional[_Union[DiskStatus, _Mapping]] = ..., cpu_kernels: _Optional[str] = ...) -> None: ...

class DiskStatus(_message.Message):
    __slots__ = ("used_bytes", "free_bytes", "total_bytes")
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    used_bytes: int
    free_bytes: int
    total_bytes: int
    def __init__(self, used_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec", "request_id", "queue_for_capacity_s")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FOR_CAPACITY_S_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    request_id: str
    queue_for_capacity_s: float
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ..., request_id: _Optional[str] = ..., queue_for_capacity_s: _Optional[float] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("name", "deadline_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    deadline_s: float
    def __init__(self, name: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "states")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    states: _containers.RepeatedScalarFieldContainer[JobState]
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., states: _Optional[_Iterable[_Union[JobState, str]]] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DeleteJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("id", "after_seq")
    ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    id: str
    after_seq: int
    def __init__(self, id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class GetLogsRequest(_message.Message):
    __slots__ = ("job_id", "role", "index", "all_tasks", "follow", "tail_lines")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ALL_TASKS_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    TAIL_LINES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    role: str
    index: int
    all_tasks: bool
    follow: bool
    tail_lines: int
    def __init__(self, job_id: _Optional[str] = ..., role: _Optional[str] = ..., index: _Optional[int] = ..., all_tasks: _Optional[bool] = ..., follow: _Optional[bool] = ..., tail_lines: _Optional[int] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("role", "index", "data")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    role: str
    index: int
    data: bytes
    def __init__(self, role: _Optional[str] = ..., index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PlanJobRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("path", "data", "offset", "size")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    path: str
    data: bytes
    offset: int
    size: int
    def __init__(self, path: _Optional[str] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class BlobRef(_message.Message):
    __slots__ = ("sha256", "size")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size: int
    def __init__(self, sha256: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class DownloadOutputRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CoordinatorDisk(_message.Message):
    __slots__ = ("disk", "blobs_bytes", "outputs_bytes", "logs_bytes", "reserve_bytes")
    DISK_FIELD_NUMBER: _ClassVar[int]
    BLOBS_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGS_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    disk: DiskStatus
    blobs_bytes: int
    outputs_bytes: int
    logs_bytes: int
    reserve_bytes: int
    def __init__(self, disk: _Optional[_Union[DiskStatus, _Mapping]] = ..., blobs_bytes: _Optional[int] = ..., outputs_bytes: _Optional[int] = ..., logs_bytes: _Optional[int] = ..., reserve_bytes: _Optional[int] = ...) -> None: ...

class RevokeRequest(_message.Message):
    __slots__ = ("name", "restore")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    name: str
    restore: bool
    def __init__(self, name: _Optional[str] = ..., restore: _Optional[bool] = ...) -> None: ...

class RevokeResponse(_message.Message):
    __slots__ = ("revoked", "streams_closed", "agents_lost")
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    STREAMS_CLOSED_FIELD_NUMBER: _ClassVar[int]
    AGENTS_LOST_FIELD_NUMBER: _ClassVar[int]
    revoked: _containers.RepeatedScalarFieldContainer[str]
    streams_closed: int
    agents_lost: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, revoked: _Optional[_Iterable[str]] = ..., streams_closed: _Optional[int] = ..., agents_lost: _Optional[_Iterable[str]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "states")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    states: _containers.RepeatedScalarFieldContainer[WorkerState]
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., states: _Optional[_Iterable[_Union[WorkerState, str]]] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "next_page_token", "coordinator_disk")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_DISK_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    next_page_token: str
    coordinator_disk: CoordinatorDisk
    def __init__(self, workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., coordinator_disk: _Optional[_Union[CoordinatorDisk, _Mapping]] = ...) -> None: ...

class QueueShare(_message.Message):
    __slots__ = ("workers", "memory_bytes")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    workers: int
    memory_bytes: int
    def __init__(self, workers: _Optional[int] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class QueueInfo(_message.Message):
    __slots__ = ("name", "nominal", "borrow", "in_use", "waiting", "running", "default")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NOMINAL_FIELD_NUMBER: _ClassVar[int]
    BORROW_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FIELD_NUMBER: _ClassVar[int]
    name: str
    nominal: QueueShare
    borrow: QueueShare
    in_use: QueueShare
    waiting: int
    running: int
    default: bool
    def __init__(self, name: _Optional[str] = ..., nominal: _Optional[_Union[QueueShare, _Mapping]] = ..., borrow: _Optional[_Union[QueueShare, _Mapping]] = ..., in_use: _Optional[_Union[QueueShare, _Mapping]] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ..., default: _Optional[bool] = ...) -> None: ...

class ListQueuesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListQueuesResponse(_message.Message):
    __slots__ = ("queues",)
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    queues: _containers.RepeatedCompositeFieldContainer[QueueInfo]
    def __init__(self, queues: _Optional[_Iterable[_Union[QueueInfo, _Mapping]]] = ...) -> None: ...

class TaskStatus(_message.Message):
    __slots__ = ("job_id", "role", "index", "state", "failure", "exit_code", "message", "in_use_bytes", "peak_bytes", "step", "total_steps", "loss", "examples_per_sec", "has_result", "test_accuracy", "test_loss", "weights_sha256", "model_path", "first_step_time", "attempt", "replica_weights_sha256", "oom", "checkpoint_step", "resumed_step", "training", "test_metrics", "notes", "largest_alloc_bytes")
    class TestMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    IN_USE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_PER_SEC_FIELD_NUMBER: _ClassVar[int]
    HAS_RESULT_FIELD_NUMBER: _ClassVar[int]
    TEST_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    TEST_LOSS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_TIME_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    OOM_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    RESUMED_STEP_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    TEST_METRICS_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    LARGEST_ALLOC_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    role: str
    index: int
    state: TaskState
    failure: FailureKind
    exit_code: int
    message: str
    in_use_bytes: int
    peak_bytes: int
    step: int
    total_steps: int
    loss: float
    examples_per_sec: float
    has_result: bool
    test_accuracy: float
    test_loss: float
    weights_sha256: str
    model_path: str
    first_step_time: float
    attempt: int
    replica_weights_sha256: _containers.RepeatedScalarFieldContainer[str]
    oom: OutOfMemory
    checkpoint_step: int
    resumed_step: int
    training: str
    test_metrics: _containers.ScalarMap[str, float]
    notes: _containers.RepeatedScalarFieldContainer[str]
    largest_alloc_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., role: _Optional[str] = ..., index: _Optional[int] = ..., state: _Optional[_Union[TaskState, str]] = ..., failure: _Optional[_Union[FailureKind, str]] = ..., exit_code: _Optional[int] = ..., message: _Optional[str] = ..., in_use_bytes: _Optional[int] = ..., peak_bytes: _Optional[int] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., loss: _Optional[float] = ..., examples_per_sec: _Optional[float] = ..., has_result: _Optional[bool] = ..., test_accuracy: _Optional[float] = ..., test_loss: _Optional[float] = ..., weights_sha256: _Optional[str] = ..., model_path: _Optional[str] = ..., first_step_time: _Optional[float] = ..., attempt: _Optional[int] = ..., replica_weights_sha256: _Optional[_Iterable[str]] = ..., oom: _Optional[_Union[OutOfMemory, _Mapping]] = ..., checkpoint_step: _Optional[int] = ..., resumed_step: _Optional[int] = ..., training: _Optional[str] = ..., test_metrics: _Optional[_Mapping[str, float]] = ..., notes: _Optional[_Iterable[str]] = ..., largest_alloc_bytes: _Optional[int] = ...) -> None: ...

class OutOfMemory(_message.Message):
    __slots__ = ("task", "allocation_bytes", "shape", "dtype", "op")
    TASK_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    task: str
    allocation_bytes: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    op: str
    def __init__(self, task: _Optional[str] = ..., allocation_bytes: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., op: _Optional[str] = ...) -> None: ...

class RegisterAgentRequest(_message.Message):
    __slots__ = ("name", "host", "device", "budget_bytes", "free_ports", "tasks", "work_dir", "pid", "shared_dir", "draining", "data_roots", "cpu_kernels")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_PORTS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    WORK_DIR_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SHARED_DIR_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DATA_ROOTS_FIELD_NUMBER: _ClassVar[int]
    CPU_KERNELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    host: str
    device: str
    budget_bytes: int
    free_ports: _containers.RepeatedScalarFieldContainer[int]
    tasks: _containers.RepeatedCompositeFieldContainer[TaskStatus]
    work_dir: str
    pid: int
    shared_dir: str
    draining: bool
    data_roots: _containers.RepeatedScalarFieldContainer[str]
    cpu_kernels: str
    def __init__(self, name: _Optional[str] = ..., host: _Optional[str] = ..., device: _Optional[str] = ..., budget_bytes: _Optional[int] = ..., free_ports: _Optional[_Iterable[int]] = ..., tasks: _Optional[_Iterable[_Union[TaskStatus, _Mapping]]] = ..., work_dir: _Optional[str] = ..., pid: _Optional[int] = ..., shared_dir: _Optional[str] = ..., draining: _Optional[bool] = ..., data_roots: _Optional[_Iterable[str]] = ..., cpu_kernels: _Optional[str] = ...) -> None: ...

class RegisterAgentResponse(_message.Message):
    __slots__ = ("session", "heartbeat_interval_s")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    session: str
    heartbeat_interval_s: float
    def __init__(self, session: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("name", "session", "memory", "tasks", "free_ports", "sent_at", "disk")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    FREE_PORTS_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    name: str
    session: str
    memory: MemoryStatus
    tasks: _containers.RepeatedCompositeFieldContainer[TaskStatus]
    free_ports: _containers.RepeatedScalarFieldContainer[int]
    sent_at: float
    disk: DiskStatus
    def __init__(self, name: _Optional[str] = ..., session: _Optional[str] = ..., memory: _Optional[_Union[MemoryStatus, _Mapping]] = ..., tasks: _Optional[_Iterable[_Union[TaskStatus, _Mapping]]] = ..., free_ports: _Optional[_Iterable[int]] = ..., sent_at: _Optional[float] = ..., disk: _Optional[_Union[DiskStatus, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("reregister",)
    REREGISTER_FIELD_NUMBER: _ClassVar[int]
    reregister: bool
    def __init__(self, reregister: _Optional[bool] = ...) -> None: ...

class ParameterServerConfig(_message.Message):
    __slots__ = ("placement", "ps_budgets_bytes")
    class PlacementEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    PS_BUDGETS_BYTES_FIELD_NUMBER: _ClassVar[int]
    placement: _containers.ScalarMap[str, int]
    ps_budgets_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, placement: _Optional[_Mapping[str, int]] = ..., ps_budgets_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class StageAssignment(_message.Message):
    __slots__ = ("replica", "stage", "role", "index", "first_layer", "last_layer", "layers", "estimated_memory_bytes", "memory_budget_bytes")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    replica: int
    stage: int
    role: str
    index: int
    first_layer: int
    last_layer: int
    layers: _containers.RepeatedScalarFieldContainer[str]
    estimated_memory_bytes: int
    memory_budget_bytes: int
    def __init__(self, replica: _Optional[int] = ..., stage: _Optional[int] = ..., role: _Optional[str] = ..., index: _Optional[int] = ..., first_layer: _Optional[int] = ..., last_layer: _Optional[int] = ..., layers: _Optional[_Iterable[str]] = ..., estimated_memory_bytes: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ...) -> None: ...

class PipelineConfig(_message.Message):
    __slots__ = ("stages", "replicas", "microbatches", "microbatch", "layout")
    STAGES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    stages: int
    replicas: int
    microbatches: int
    microbatch: int
    layout: _containers.RepeatedCompositeFieldContainer[StageAssignment]
    def __init__(self, stages: _Optional[int] = ..., replicas: _Optional[int] = ..., microbatches: _Optional[int] = ..., microbatch: _Optional[int] = ..., layout: _Optional[_Iterable[_Union[StageAssignment, _Mapping]]] = ...) -> None: ...

class AgentSettings(_message.Message):
    __slots__ = ("output_dir", "threads", "device", "blob_dir", "shared_dir", "data_roots")
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOB_DIR_FIELD_NUMBER: _ClassVar[int]
    SHARED_DIR_FIELD_NUMBER: _ClassVar[int]
    DATA_ROOTS_FIELD_NUMBER: _ClassVar[int]
    output_dir: str
    threads: int
    device: str
    blob_dir: str
    shared_dir: str
    data_roots: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, output_dir: _Optional[str] = ..., threads: _Optional[int] = ..., device: _Optional[str] = ..., blob_dir: _Optional[str] = ..., shared_dir: _Optional[str] = ..., data_roots: _Optional[_Iterable[str]] = ...) -> None: ...

class TaskConfig(_message.Message):
    __slots__ = ("version", "job_id", "role", "index", "spec", "memory_budget_bytes", "report_interval_s", "ps_placement", "stage_layout", "agent", "restart", "probe")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPORT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    PS_PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    STAGE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    version: int
    job_id: str
    role: str
    index: int
    spec: JobSpec
    memory_budget_bytes: int
    report_interval_s: float
    ps_placement: ParameterServerConfig
    stage_layout: PipelineConfig
    agent: AgentSettings
    restart: int
    probe: bool
    def __init__(self, version: _Optional[int] = ..., job_id: _Optional[str] = ..., role: _Optional[str] = ..., index: _Optional[int] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., memory_budget_bytes: _Optional[int] = ..., report_interval_s: _Optional[float] = ..., ps_placement: _Optional[_Union[ParameterServerConfig, _Mapping]] = ..., stage_layout: _Optional[_Union[PipelineConfig, _Mapping]] = ..., agent: _Optional[_Union[AgentSettings, _Mapping]] = ..., restart: _Optional[int] = ..., probe: _Optional[bool] = ...) -> None: ...

class StartTask(_message.Message):
    __slots__ = ("job_id", "role", "index", "tf_config", "memory_budget_bytes", "attempt", "config")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TF_CONFIG_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    role: str
    index: int
    tf_config: str
    memory_budget_bytes: int
    attempt: int
    config: TaskConfig
    def __init__(self, job_id: _Optional[str] = ..., role: _Optional[str] = ..., index: _Optional[int] = ..., tf_config: _Optional[str] = ..., memory_budget_bytes: _Optional[int] = ..., attempt: _Optional[int] = ..., config: _Optional[_Union[TaskConfig, _Mapping]] = ...) -> None: ...

class StopTask(_message.Message):
    __slots__ = ("job_id", "role", "index", "reason", "attempt")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    role: str
    index: int
    reason: str
    attempt: int
    def __init__(self, job_id: _Optional[str] = ..., role: _Optional[str] = ..., index: _Optional[int] = ..., reason: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class PurgeJob(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class Notice(_message.Message):
    __slots__ = ("job_id", "step", "attempt")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    attempt: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class AgentCommand(_message.Message):
    __slots__ = ("start", "stop", "purge", "notice")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PURGE_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    start: StartTask
    stop: StopTask
    purge: PurgeJob
    notice: Notice
    def __init__(self, start: _Optional[_Union[StartTask, _Mapping]] = ..., stop: _Optional[_Union[StopTask, _Mapping]] = ..., purge: _Optional[_Union[PurgeJob, _Mapping]] = ..., notice: _Optional[_Union[Notice, _Mapping]] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("name", "session")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    session: str
    def __init__(self, name: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class ReportTaskRequest(_message.Message):
    __slots__ = ("name", "session", "status")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    name: str
    session: str
    status: TaskStatus
    def __init__(self, name: _Optional[str] = ..., session: _Optional[str] = ..., status: _Optional[_Union[TaskStatus, _Mapping]] = ...) -> None: ...

class ReportTaskResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AppendLogsRequest(_message.Message):
    __slots__ = ("name", "session", "job_id", "role", "index", "data", "attempt")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    name: str
    session: str
    job_id: str
    role: str
    index: int
    data: bytes
    attempt: int
    def __init__(self, name: _Optional[str] = ..., session: _Optional[str] = ..., job_id: _Optional[str] = ..., role: _Optional[str] = ..., index: _Optional[int] = ..., data: _Optional[bytes] = ..., attempt: _Optional[int] = ...) -> None: ...

class AppendLogsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FetchBlobRequest(_message.Message):
    __slots__ = ("name", "session", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    session: str
    sha256: str
    def __init__(self, name: _Optional[str] = ..., session: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class OutputChunk(_message.Message):
    __slots__ = ("name", "session", "job_id", "chunk", "role", "index", "attempt")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    name: str
    session: str
    job_id: str
    chunk: FileChunk
    role: str
    index: int
    attempt: int
    def __init__(self, name: _Optional[str] = ..., session: _Optional[str] = ..., job_id: _Optional[str] = ..., chunk: _Optional[_Union[FileChunk, _Mapping]] = ..., role: _Optional[str] = ..., index: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class UploadOutputResponse(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: int
    def __init__(self, size: _Optional[int] = ...) -> None: ...

class DrainAgentRequest(_message.Message):
    __slots__ = ("name", "session", "deadline_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    session: str
    deadline_s: float
    def __init__(self, name: _Optional[str] = ..., session: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class DrainAgentResponse(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: int
    def __init__(self, tasks: _Optional[int] = ...) -> None: ...
