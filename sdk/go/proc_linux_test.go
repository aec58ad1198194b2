package cbserve_test

import (
	"os/exec"
	"syscall"
)

// killWithParent makes the kernel kill the server if the test binary dies without stopping it
// (a panic, `go test -timeout`, SIGKILL).
func killWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
