package cbserve_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	cbserve "github.com/cbserve/cbserve/sdk/go"
)

// The weights checksum's vectors, shared with the Python and Java SDKs' tests: byte i of a
// tensor's data is (i * 131 + seed) mod 256.
type checksumVectors struct {
	Algorithm string `json:"algorithm"`
	Digest    string `json:"digest"`
	Tensors   []struct {
		Name   string  `json:"name"`
		DType  string  `json:"dtype"`
		Shape  []int64 `json:"shape"`
		Seed   int     `json:"seed"`
		Digest string  `json:"digest"`
	} `json:"tensors"`
}

var dtypeSizes = map[string]int64{"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "U8": 1}

func TestChecksumOfTheSharedVectors(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("..", "..", "tests", "data", "weights_checksum_vectors.json"))
	if err != nil {
		t.Fatal(err)
	}
	var vectors checksumVectors
	if err := json.Unmarshal(raw, &vectors); err != nil {
		t.Fatal(err)
	}
	if vectors.Algorithm != cbserve.ChecksumAlgorithm {
		t.Fatalf("vectors of %q; ChecksumAlgorithm is %q", vectors.Algorithm, cbserve.ChecksumAlgorithm)
	}
	tensors := make([]cbserve.Tensor, 0, len(vectors.Tensors))
	for _, vector := range vectors.Tensors {
		size := dtypeSizes[vector.DType]
		for _, dim := range vector.Shape {
			size *= dim
		}
		data := make([]byte, size)
		for i := range data {
			data[i] = byte((i*131 + vector.Seed) % 256)
		}
		tensor := cbserve.Tensor{Name: vector.Name, DType: vector.DType, Shape: vector.Shape, Data: data}
		if digest, err := cbserve.TensorDigest(tensor); err != nil || digest != vector.Digest {
			t.Errorf("TensorDigest(%s) = %s, %v; want %s", vector.Name, digest, err, vector.Digest)
		}
		tensors = append(tensors, tensor)
	}
	checksum, err := cbserve.ChecksumOf(tensors)
	if err != nil || checksum.Digest != vectors.Digest {
		t.Fatalf("ChecksumOf(vectors) = %+v, %v; want digest %s", checksum, err, vectors.Digest)
	}
}
