package dev.cbserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import com.google.gson.Strictness;
import com.google.gson.stream.JsonReader;
import com.google.gson.stream.JsonToken;
import java.io.IOException;
import java.io.StringReader;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Optional;
import java.util.Set;
import org.junit.jupiter.api.Test;

/**
 * min_p, stop token ids (and the stop reason), skip_special_tokens, priority, prompt logprobs and
 * structured output against the test server (tiny random Llama, one token per byte, no EOS id).
 */
class SamplingFieldsTest extends ServerTest {

  @Test
  void minPOneAtTemperatureOneIsGreedy() {
    Completion greedy = client.generate(Prompt.text("Hello"), greedy(16));
    for (long seed = 1; seed <= 3; seed++) {
      SamplingParams params =
          SamplingParams.builder()
              .maxNewTokens(16)
              .temperature(1)
              .minP(1.0)
              .ignoreEos(true)
              .seed(seed)
              .build();
      Completion sampled = client.generate(Prompt.text("Hello"), params);
      assertEquals(greedy.tokenIds(), sampled.tokenIds(), "seed " + seed);
    }
  }

  @Test
  void aStopTokenIdEndsTheOutputThereWithStop() {
    Completion full = client.generate(Prompt.text("Hello"), greedy(24));
    TokenIds tokens = full.tokenIds();
    int stop = tokens.getInt(tokens.size() / 2);
    int end = tokens.indexOf(stop) + 1; // the first time it is generated
    int absent = 0;
    while (tokens.contains(absent)) {
      absent++;
    }
    SamplingParams params =
        SamplingParams.builder()
            .maxNewTokens(24)
            .temperature(0)
            .ignoreEos(true) // stop token ids end the request all the same
            .stopTokenIds(absent, stop)
            .build();

    Completion cut = client.generate(Prompt.text("Hello"), params);
    assertEquals(FinishReason.STOP, cut.finishReason(), "full output: " + tokens);
    assertEquals(tokens.subList(0, end), cut.tokenIds());
    assertEquals(stop, cut.tokenIds().getInt(cut.tokenIds().size() - 1));
    assertEquals(Optional.of(stop), cut.stopTokenId());
    assertEquals(Optional.empty(), cut.stopString());

    Chunk last = lastChunk(client.stream(Prompt.text("Hello"), params));
    assertEquals(FinishReason.STOP, last.finishReason());
    assertEquals(Optional.of(stop), last.stopTokenId());
    assertEquals(Optional.empty(), last.stopString());

    // A request that runs to its length has no stop reason.
    assertEquals(FinishReason.LENGTH, full.finishReason());
    assertEquals(Optional.empty(), full.stopTokenId());
    assertEquals(Optional.empty(), full.stopString());
  }

  @Test
  void stopTokenIdsAtOrAboveTheVocabularyAreRefusedByTheServer() {
    SamplingParams params =
        SamplingParams.builder().maxNewTokens(4).stopTokenIds(CbserveServer.VOCAB_SIZE).build();
    InvalidArgumentException e =
        assertThrows(
            InvalidArgumentException.class, () -> client.generate(Prompt.text("x"), params));
    assertTrue(e.getMessage().contains("stop_token_ids"), e.getMessage());
  }

  @Test
  void skipSpecialTokensIsAccepted() {
    // The byte-level test tokenizer has no special tokens: the text is the same either way.
    Completion skipped = client.generate(Prompt.text("Hello"), greedy(12));
    SamplingParams kept =
        SamplingParams.builder()
            .maxNewTokens(12)
            .temperature(0)
            .ignoreEos(true)
            .skipSpecialTokens(false)
            .build();
    Completion completion = client.generate(Prompt.text("Hello"), kept);
    assertEquals(skipped.tokenIds(), completion.tokenIds());
    assertEquals(skipped.text(), completion.text());
  }

  @Test
  void priorityIsAcceptedAndOutOfBoundsRefusedByTheBuilder() {
    Completion plain = client.generate(Prompt.text("Hello"), greedy(8));
    for (int priority :
        new int[] {-7, 0, 42, SamplingBounds.MIN_PRIORITY, SamplingBounds.MAX_PRIORITY}) {
      RequestOptions options = RequestOptions.builder().priority(priority).build();
      assertEquals(priority, options.priority());
      Completion c = client.generate(Prompt.text("Hello"), greedy(8), options);
      assertEquals(plain.tokenIds(), c.tokenIds(), "priority " + priority);
    }
    String id =
        client.submit(
            Prompt.text("Hello"), greedy(8), RequestOptions.builder().priority(-1).build());
    try (ChunkIterator chunks = client.results(id)) {
      assertEquals(plain.tokenIds(), drainTokens(chunks, 0));
    }

    RequestOptions.Builder builder = RequestOptions.builder();
    IllegalArgumentException above =
        assertThrows(
            IllegalArgumentException.class,
            () -> builder.priority((long) SamplingBounds.MAX_PRIORITY + 1));
    assertTrue(above.getMessage().startsWith("priority must be an int in ["), above.getMessage());
    IllegalArgumentException below =
        assertThrows(
            IllegalArgumentException.class,
            () -> builder.priority((long) SamplingBounds.MIN_PRIORITY - 1));
    assertTrue(below.getMessage().contains("priority"), below.getMessage());
  }

  @Test
  void theBuildersRefuseEachNewFieldOutOfBounds() {
    SamplingParams.Builder b = SamplingParams.builder();
    assertNamed("sampling.min_p", () -> b.minP(SamplingBounds.MAX_MIN_P + 0.5));
    assertNamed("sampling.min_p", () -> b.minP(-0.5));
    int[] tooMany = new int[SamplingBounds.MAX_STOP_TOKEN_IDS + 1];
    assertNamed("sampling.stop_token_ids", () -> b.stopTokenIds(tooMany));
    assertNamed("sampling.stop_token_ids", () -> b.stopTokenIds(-1));
    assertNamed(
        "sampling.prompt_logprobs",
        () -> b.promptLogprobs(SamplingBounds.MAX_PROMPT_LOGPROBS + 1));
    assertNamed("sampling.prompt_logprobs", () -> b.promptLogprobs(-1));
    String tooLong = "a".repeat(SamplingBounds.MAX_STRUCTURED_OUTPUT_CHARS + 1);
    assertNamed("sampling.structured_output.json_schema", () -> b.jsonSchema(tooLong));
    assertNamed("sampling.structured_output.regex", () -> b.regex(""));
    assertNamed("sampling.structured_output.grammar", () -> b.grammar(tooLong));
    b.regex("[0-9]+");
    assertNamed("jsonSchema", () -> b.jsonSchema("{}"));
    assertNamed("jsonObject", b::jsonObject);
    assertNamed("grammar", () -> b.grammar("root ::= \"x\""));
    assertNamed(
        "priority",
        () -> RequestOptions.builder().priority((long) SamplingBounds.MAX_PRIORITY + 1));
    // Nothing refused reached the parameters.
    assertEquals("SamplingParams{regex=[0-9]+}", b.build().toString());
  }

  @Test
  void promptLogprobsComeWithTheFirstGeneratedToken() {
    byte[] prompt = "Hello".getBytes(StandardCharsets.US_ASCII); // one token per byte
    SamplingParams params =
        SamplingParams.builder()
            .maxNewTokens(4)
            .temperature(0)
            .ignoreEos(true)
            .promptLogprobs(2)
            .build();
    Completion c = client.generate(Prompt.text("Hello"), params);
    assertEquals(FinishReason.LENGTH, c.finishReason(), String.valueOf(c.error()));
    assertEquals(client.generate(Prompt.text("Hello"), greedy(4)).tokenIds(), c.tokenIds());
    List<PromptLogprob> lps = c.promptLogprobs();
    assertEquals(prompt.length - 1, lps.size(), "one per prompt token after the first: " + lps);
    for (int i = 0; i < lps.size(); i++) {
      PromptLogprob lp = lps.get(i);
      assertEquals(prompt[i + 1], lp.tokenId(), "entry " + i);
      assertTrue(lp.logprob() <= 0 && Float.isFinite(lp.logprob()), lp.toString());
      assertEquals(2, lp.topLogprobs().size(), lp.toString());
      TopLogprob first = lp.topLogprobs().get(0);
      TopLogprob second = lp.topLogprobs().get(1);
      assertTrue(first.logprob() >= second.logprob(), "most likely first: " + lp);
      assertTrue(first.logprob() >= lp.logprob() - 1e-4f, "no token beats the top one: " + lp);
      for (TopLogprob top : lp.topLogprobs()) {
        if (top.tokenId() == lp.tokenId()) {
          assertEquals(lp.logprob(), top.logprob(), 1e-4f, lp.toString());
        }
      }
    }

    // Streamed: on the chunk of the first generated token only.
    List<Chunk> chunks = new ArrayList<>();
    try (ChunkIterator stream = client.stream(Prompt.text("Hello"), params)) {
      stream.forEachRemaining(chunks::add);
    }
    List<Chunk> carrying = new ArrayList<>();
    for (Chunk chunk : chunks) {
      if (!chunk.promptLogprobs().isEmpty()) {
        carrying.add(chunk);
      }
    }
    assertEquals(1, carrying.size(), chunks.toString());
    Chunk first = carrying.get(0);
    assertEquals(0, first.tokenIndex());
    assertFalse(first.tokenIds().isEmpty());
    assertEquals(lps.size(), first.promptLogprobs().size());
    for (int i = 0; i < lps.size(); i++) {
      assertEquals(lps.get(i).tokenId(), first.promptLogprobs().get(i).tokenId());
      assertEquals(lps.get(i).logprob(), first.promptLogprobs().get(i).logprob(), 1e-4f);
    }

    // 0: the prompt tokens' own logprobs, no alternatives.
    SamplingParams own =
        SamplingParams.builder().maxNewTokens(2).temperature(0).promptLogprobs(0).build();
    List<PromptLogprob> owned = client.generate(Prompt.text("Hello"), own).promptLogprobs();
    assertEquals(prompt.length - 1, owned.size());
    for (PromptLogprob lp : owned) {
      assertTrue(lp.topLogprobs().isEmpty(), lp.toString());
    }
    // Unset: none.
    assertTrue(client.generate(Prompt.text("Hello"), greedy(2)).promptLogprobs().isEmpty());
  }

  @Test
  void aJsonSchemaOutputParses() throws IOException {
    String schema =
        "{\"type\": \"object\", \"properties\": {\"ok\": {\"type\": \"boolean\"},"
            + " \"color\": {\"enum\": [\"red\", \"green\", \"blue\"]}},"
            + " \"required\": [\"ok\", \"color\"], \"additionalProperties\": false}";
    for (long seed = 0; seed < 3; seed++) {
      SamplingParams params =
          SamplingParams.builder()
              .maxNewTokens(64)
              .temperature(seed == 0 ? 0 : 1)
              .seed(seed)
              // The grammar ends the request through an EOS id, and the test model has none: a
              // newline, which JSON allows after the value (and the grammar nowhere inside it).
              .eos('\n')
              .jsonSchema(schema)
              .build();
      Completion c = client.generate(Prompt.text("Answer in JSON: "), params);
      assertEquals(FinishReason.EOS, c.finishReason(), c.text() + " / " + c.error());
      JsonReader reader = new JsonReader(new StringReader(c.text()));
      reader.setStrictness(Strictness.STRICT);
      JsonElement value = JsonParser.parseReader(reader);
      assertEquals(JsonToken.END_DOCUMENT, reader.peek(), c.text());
      assertTrue(value.isJsonObject(), c.text());
      JsonObject object = value.getAsJsonObject();
      assertEquals(Set.of("ok", "color"), object.keySet(), c.text());
      assertTrue(object.get("ok").getAsJsonPrimitive().isBoolean(), c.text());
      assertTrue(
          Set.of("red", "green", "blue").contains(object.get("color").getAsString()), c.text());
    }
  }

  @Test
  void aSchemaThatDoesNotCompileIsRefused() {
    SamplingParams params =
        SamplingParams.builder()
            .maxNewTokens(8)
            .eos('\n')
            .jsonSchema("{\"type\": \"strin\"}")
            .build();
    InvalidArgumentException e =
        assertThrows(
            InvalidArgumentException.class, () -> client.generate(Prompt.text("x"), params));
    // The server quotes the compiler ("structured_output: the json_schema does not compile: ...").
    assertTrue(e.getMessage().contains("does not compile"), e.getMessage());
  }

  private static Chunk lastChunk(ChunkIterator chunks) {
    Chunk last = null;
    try (chunks) {
      while (chunks.hasNext()) {
        last = chunks.next();
      }
    }
    assertNotNull(last);
    return last;
  }

  private static void assertNamed(String field, org.junit.jupiter.api.function.Executable setter) {
    IllegalArgumentException e = assertThrows(IllegalArgumentException.class, setter);
    assertTrue(e.getMessage().startsWith(field), field + ": " + e.getMessage());
  }
}
