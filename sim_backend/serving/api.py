"""The serving API's request/result types (what clients build and receive).

ChatRequest, SamplingParams and the stream events are the vocabulary of the InferencePlane.
"""

from sim_backend.serving.engine import (ROLES, STAGES, STOP_TYPES, ChatRequest, DoneEvent, RequestHandle,
                                        RequestResult, RequestState, SlotInfo, StageTimes, Timings, TokenEvent,
                                        validate_request)
from sim_backend.serving.sampling import SamplingParams

__all__ = ["ROLES", "STAGES", "STOP_TYPES", "ChatRequest", "DoneEvent", "RequestHandle", "RequestResult",
           "RequestState", "SamplingParams", "SlotInfo", "StageTimes", "Timings", "TokenEvent", "validate_request"]
