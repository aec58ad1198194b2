package cbserve_test

// The kept probability mass against the real server (WithReturnKeptMass): each token's
// LogKeptMass equals the renormalising constant of top-k, top-p and min-p computed here from the
// same step's raw log-probabilities (temperature 1, so the raw distribution is the one they
// truncate), and a processed log-probability plus it is the raw one.

import (
	"errors"
	"math"
	"slices"
	"testing"

	cbserve "github.com/cbserve/cbserve/sdk/go"
)

type truncation struct {
	name       string
	topK       int
	topP, minP float64
}

func (c truncation) options() []cbserve.GenerateOption {
	var options []cbserve.GenerateOption
	if c.topK > 0 {
		options = append(options, cbserve.WithTopK(c.topK))
	}
	if c.topP > 0 {
		options = append(options, cbserve.WithTopP(c.topP))
	}
	if c.minP > 0 {
		options = append(options, cbserve.WithMinP(c.minP))
	}
	return options
}

// referenceKeptMass is the probability the truncation keeps of the distribution whose most likely
// tokens `top` lists (raw log-probabilities, most likely first): top-k, then top-p on what top-k
// kept, then min-p. ok is false when the kept tokens may reach past the listed ones.
func (c truncation) referenceKeptMass(top []cbserve.TopLogprob) (mass float64, ok bool) {
	probs := make([]float64, len(top))
	for i, alternative := range top {
		probs[i] = math.Exp(float64(alternative.Logprob))
	}
	kept := len(probs)
	if c.topK > 0 {
		kept = min(kept, c.topK)
	} else if c.topP == 0 && c.minP == 0 {
		return 0, false
	}
	if c.topP > 0 {
		total := 1.0 // the whole vocabulary's, unless top-k kept fewer
		if c.topK > 0 {
			total = sum(probs[:kept])
		}
		before, i := 0.0, 0
		for ; i < kept && before/total < c.topP; i++ {
			before += probs[i]
		}
		if i == len(probs) && c.topK == 0 {
			return 0, false
		}
		kept = i
	}
	if c.minP > 0 {
		i := 0
		for i < kept && probs[i] >= c.minP*probs[0] {
			i++
		}
		if i == len(probs) {
			return 0, false
		}
		kept = i
	}
	return sum(probs[:kept]), true
}

func sum(values []float64) float64 {
	total := 0.0
	for _, value := range values {
		total += value
	}
	return total
}

func TestKeptMassEqualsTheReferenceRenormalisingConstant(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	cases := []truncation{
		{name: "top-k", topK: 5},
		{name: "top-p", topP: 0.05},
		{name: "min-p", minP: 0.95},
		{name: "top-k, top-p and min-p", topK: 15, topP: 0.5, minP: 0.85},
	}
	for _, c := range cases {
		generate := func(mode cbserve.LogprobsMode) *cbserve.Completion {
			t.Helper()
			options := append(c.options(), cbserve.WithMaxNewTokens(5), cbserve.WithIgnoreEOS(),
				cbserve.WithTemperature(1), cbserve.WithSeed(9), cbserve.WithLogprobs(cbserve.MaxTopLogprobs),
				cbserve.WithLogprobsMode(mode), cbserve.WithReturnKeptMass())
			completion, err := client.Generate(ctx, cbserve.Tokens(5, 6, 7, 8), options...)
			if err != nil {
				t.Fatalf("%s: Generate: %v", c.name, err)
			}
			return completion
		}
		raw, processed := generate(cbserve.LogprobsRaw), generate(cbserve.LogprobsProcessed)
		if !slices.Equal(raw.TokenIDs, processed.TokenIDs) || len(raw.Logprobs) != 5 {
			t.Fatalf("%s: tokens %v (raw) and %v (processed), %d logprobs", c.name, raw.TokenIDs, processed.TokenIDs, len(raw.Logprobs))
		}
		for step, every := range raw.Logprobs {
			drawn := processed.Logprobs[step]
			if every.LogKeptMass == nil || drawn.LogKeptMass == nil {
				t.Fatalf("%s, step %d: no LogKeptMass (raw %v, processed %v)", c.name, step, every.LogKeptMass, drawn.LogKeptMass)
			}
			want, ok := c.referenceKeptMass(every.Top)
			if !ok {
				t.Fatalf("%s, step %d: the kept tokens reach past the %d listed; narrow the case", c.name, step, len(every.Top))
			}
			if want > 0.999 {
				t.Fatalf("%s, step %d: kept mass %g; the case must truncate", c.name, step, want)
			}
			got := float64(*every.LogKeptMass)
			if math.Abs(got-math.Log(want)) > 1e-4 || *drawn.LogKeptMass != *every.LogKeptMass {
				t.Errorf("%s, step %d: LogKeptMass %g (raw mode), %g (processed mode); reference log %g = %g",
					c.name, step, got, *drawn.LogKeptMass, want, math.Log(want))
			}
			if back := float64(drawn.Logprob) + float64(*drawn.LogKeptMass); math.Abs(back-float64(every.Logprob)) > 1e-4 {
				t.Errorf("%s, step %d: processed logprob %g + log kept mass %g = %g; want the raw logprob %g",
					c.name, step, drawn.Logprob, *drawn.LogKeptMass, back, every.Logprob)
			}
		}
	}
}

func TestKeptMassIsNilUnlessAskedAndRefusedForGreedy(t *testing.T) {
	client, ctx := newClient(t), testContext(t)
	plain, err := client.Generate(ctx, cbserve.Tokens(5, 6), cbserve.WithMaxNewTokens(2),
		cbserve.WithTemperature(1), cbserve.WithTopK(5), cbserve.WithLogprobs(0))
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	for step, entry := range plain.Logprobs {
		if entry.LogKeptMass != nil {
			t.Errorf("step %d: LogKeptMass %g without WithReturnKeptMass; want nil", step, *entry.LogKeptMass)
		}
	}
	_, err = client.Generate(ctx, cbserve.Tokens(5, 6), cbserve.WithMaxNewTokens(2),
		cbserve.WithTemperature(0), cbserve.WithReturnKeptMass())
	if !errors.Is(err, cbserve.ErrInvalidArgument) || !containsAll(err.Error(), "sampling.return_kept_mass", "needs a request that samples") {
		t.Errorf("greedy WithReturnKeptMass: %v; want ErrInvalidArgument naming sampling.return_kept_mass", err)
	}
}
