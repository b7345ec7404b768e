"""Register map of the simulated board (per-chip and board registers).

Reads of any mapped register are allowed to the maintenance plane; writes
only to registers marked writable. The firmware/CalcoreRT commit lives in
a fixed register as on the real board (facts.md F1: "read CalcoreRT commit from
a fixed register").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class RegisterDef:
    """One register: name, 32-bit address, writable flag, power-on value, meaning."""

    name: str
    address: int
    writable: bool
    reset_value: int
    description: str


def _chip_regs(chip: int) -> list[RegisterDef]:
    base = 0x1000 * (chip + 1)
    return [
        RegisterDef(f"CHIP{chip}_STATUS", base + 0x00, False, 0x1, "bit0 ready, bit1 fault, bit2 memory cleared"),
        RegisterDef(f"CHIP{chip}_JOBS_DONE", base + 0x04, False, 0, "jobs completed since power-on (mod 2^32)"),
        RegisterDef(f"CHIP{chip}_CCU_EXC", base + 0x08, False, 0, "CCU exceptions since power-on"),
        RegisterDef(f"CHIP{chip}_CLK_DIV", base + 0x0C, True, 1, "core clock divider (1 = full speed)"),
        RegisterDef(f"CHIP{chip}_SCRATCH", base + 0x10, True, 0, "scratch register for diagnostics"),
    ]


REGISTER_MAP: tuple[RegisterDef, ...] = tuple(
    [
        RegisterDef("BOARD_ID", 0x0000, False, 0xCA1C_0002, "board id: Calculet, 2 chiplets"),
        RegisterDef("CALCORERT_COMMIT", 0x0004, False, 0x03F9_C2AB, "CalcoreRT firmware commit (short hash)"),
        RegisterDef("BOARD_STATUS", 0x0008, False, 0x1, "bit0 powered, bit1 calbin configured"),
        RegisterDef("D2D_LINK_ERR", 0x000C, False, 0, "chiplet-to-chiplet link errors since power-on"),
        RegisterDef("WATCHDOG_MS", 0x0010, True, 5000, "job watchdog in ms"),
    ]
    + _chip_regs(0)
    + _chip_regs(1)
)


class RegisterFile:
    """Thread-safe register values keyed by name; power-on values from REGISTER_MAP."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._defs = {r.name: r for r in REGISTER_MAP}
        self._by_addr = {r.address: r for r in REGISTER_MAP}
        self._values: dict[str, int] = {}
        self.power_on()

    def power_on(self) -> None:
        with self._lock:
            self._values = {r.name: r.reset_value for r in REGISTER_MAP}

    def resolve(self, key: str | int) -> RegisterDef:
        """Register by name or address; KeyError naming the key otherwise."""
        if isinstance(key, int):
            if key not in self._by_addr:
                raise KeyError(f"no register at address 0x{key:04X}")
            return self._by_addr[key]
        if key not in self._defs:
            raise KeyError(f"no register named {key!r}")
        return self._defs[key]

    def read(self, key: str | int) -> int:
        d = self.resolve(key)
        with self._lock:
            return self._values[d.name]

    def write(self, key: str | int, value: int, *, force: bool = False) -> None:
        """Write a register. PermissionError if read-only (``force`` is for the device model itself)."""
        d = self.resolve(key)
        if not d.writable and not force:
            raise PermissionError(f"register {d.name} is read-only")
        if not 0 <= int(value) < 2**32:
            raise ValueError(f"register value must fit 32 bits, got {value}")
        with self._lock:
            self._values[d.name] = int(value)

    def bump(self, key: str, by: int = 1) -> None:
        with self._lock:
            self._values[key] = (self._values[key] + by) % 2**32

    def set_bits(self, key: str, mask: int, on: bool) -> None:
        with self._lock:
            v = self._values[key]
            self._values[key] = (v | mask) if on else (v & ~mask)

    def dump(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
