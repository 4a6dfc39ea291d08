"""The simulator: the real ``core.Scheduler`` and KV manager on a virtual clock, priced by a cost model.

PURE PYTHON, like ``core/``: no torch, no numpy, no files, no clock. ``SimExecutor`` implements the executor
protocol (``execute(SchedulerOutput) -> ModelOutput``) and prices each step with a cost model
(``cost_model.py``: a roofline over a ``ModelSpec`` from ``model_specs.py`` on a ``Hardware`` from
``hardware.py``); ``loop.simulate`` drives the scheduler with it. ``fit.py`` fits a CPU's efficiencies and
overheads to measured step times (``conveyor sim calibrate``); ``bench/simulate.py`` turns a simulation into the
same results document as a real ``bench compare`` run.
"""

from conveyor.sim.cost_model import ConstantCostModel, CostModel, RooflineCostModel, StepCost, StepShape
from conveyor.sim.executor import SequenceTracker, SimExecutor
from conveyor.sim.hardware import HARDWARE, Hardware, get_hardware
from conveyor.sim.loop import SimResult, simulate
from conveyor.sim.model_specs import MODELS, ModelSpec, get_model_spec

__all__ = [
    "HARDWARE", "MODELS", "ConstantCostModel", "CostModel", "Hardware", "ModelSpec", "RooflineCostModel",
    "SequenceTracker", "SimExecutor", "SimResult", "StepCost", "StepShape", "get_hardware", "get_model_spec",
    "simulate",
]
