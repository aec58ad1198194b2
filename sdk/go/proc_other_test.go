//go:build !linux

package cbserve_test

import "os/exec"

// killWithParent is a no-op where there is no parent-death signal: TestMain still stops the
// server on every normal exit.
func killWithParent(*exec.Cmd) {}
