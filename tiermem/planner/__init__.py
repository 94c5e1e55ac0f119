"""``policy="auto"``: profile a step, plan a tier per saved tensor under the
budgets, follow the plan, correct it from measurement, explain it.

- :mod:`.profile`: what the profiled step saved and when backward needed it;
  :mod:`.recorder`: the observer that records it;
- :mod:`.rates`: copy, disk and pointwise rates measured on this machine;
- :mod:`.solver`: the cost model and the choice (NOTE [Planner cost model]);
- :mod:`.plan`: the :class:`Plan` (orders, predictions, measurements, reasons;
  the ``checkpoint="auto"`` blocks' choices, :class:`PlannedBlock`);
- :mod:`.lifecycle`: the :class:`Planner` an Offloader holds: the state
  machine per signature and the closed loop; :mod:`.planning`: profile to
  plan; :mod:`.runtime`: a step's planning (the pack hook's answers);
  :mod:`.tracking_cost`: what producer tracking costs a plan.
"""

from .plan import Plan, PlannedBlock, PlannedTensor
from .rates import Rates, measure_rates
from .lifecycle import Planner

__all__ = ["Plan", "PlannedBlock", "PlannedTensor", "Planner", "Rates", "measure_rates"]
