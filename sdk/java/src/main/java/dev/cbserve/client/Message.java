package dev.cbserve.client;

import java.util.Objects;

/**
 * One message of a chat prompt ({@link Prompt#chat(Message...)}), rendered on the server with the
 * model's chat template.
 *
 * @param role the speaker's role as the template knows it: usually "system", "user", "assistant"
 * @param content the message text
 */
public record Message(String role, String content) {
  /** Checks that neither part is null. */
  public Message {
    Objects.requireNonNull(role, "role");
    Objects.requireNonNull(content, "content");
  }

  /** A message with any role. */
  public static Message of(String role, String content) {
    return new Message(role, content);
  }

  /** A "system" message. */
  public static Message system(String content) {
    return new Message("system", content);
  }

  /** A "user" message. */
  public static Message user(String content) {
    return new Message("user", content);
  }

  /** An "assistant" message. */
  public static Message assistant(String content) {
    return new Message("assistant", content);
  }
}
